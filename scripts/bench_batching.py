"""`make bench`: what dynamic batching buys, against the engine's own limit, in one run.

For `resnet18` and `mlp_wide` it measures (a) the raw Paddle predictor in this process at the
batch sizes the server uses (the engine's limit on this machine), (b) the server with batching
off and (c) with batching on, under a closed-loop load of single-row requests at several
concurrency levels: throughput, p50/p90/p99 latency and the server's RSS (front-end plus
workers). Results are ratios within the run, because machines are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from scripts.bench_common import closed_loop, percentiles_ms, rss_bytes, write_json
from tests.servers import EXAMPLE_MODELS, ServerProcess

MODELS = {"resnet18": (3, 224, 224), "mlp_wide": (2048,)}
CONCURRENCY = (1, 8, 64)


@dataclass
class Row:
    model: str
    setup: str  # raw, batching-off, batching-on
    concurrency: int  # raw: the batch size
    rows_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_batch: float
    rss_mb: float


def raw_predictor(model: str, batch_sizes: list[int], duration: float) -> list[Row]:
    """The engine alone: one predictor configured as the server's workers are."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    # As in the server's CPU workers: OpenMP threads spinning next to other work on a
    # small machine would make the reference slower than it is.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore", message="No ccache found")
    from paddle import inference

    directory = EXAMPLE_MODELS / model / "1"
    config = inference.Config(
        str(directory / "inference.json"), str(directory / "inference.pdiparams")
    )
    config.disable_glog_info()
    config.disable_gpu()
    config.enable_mkldnn()
    config.set_cpu_math_library_num_threads(1)
    predictor = inference.create_predictor(config)
    handle = predictor.get_input_handle(predictor.get_input_names()[0])
    rows = []
    for batch in batch_sizes:
        x = np.random.default_rng(0).standard_normal((batch, *MODELS[model]), dtype=np.float32)
        latencies: list[float] = []
        end = time.perf_counter() + duration
        for _ in range(2):  # warm-up for this shape
            handle.reshape(list(x.shape))
            handle.copy_from_cpu(x)
            predictor.run()
        while (start := time.perf_counter()) < end or len(latencies) < 3:
            handle.reshape(list(x.shape))
            handle.copy_from_cpu(x)
            predictor.run()
            predictor.get_output_handle(predictor.get_output_names()[0]).copy_to_cpu()
            latencies.append(time.perf_counter() - start)
        rate = batch * len(latencies) / sum(latencies)
        rows.append(
            Row(
                model,
                "raw",
                batch,
                round(rate, 1),
                **percentiles_ms(latencies),
                mean_batch=batch,
                rss_mb=0.0,
            )
        )
        print(f"  raw {model} batch {batch:<3} {rate:>9.1f} rows/s", flush=True)
    return rows


def repository(root: Path, model: str, batching: bool) -> Path:
    """The example model with its config, minus dynamic_batching when batching is off."""
    target = root / ("on" if batching else "off") / model
    target.mkdir(parents=True)
    (target / "1").symlink_to(EXAMPLE_MODELS / model / "1")
    config = (EXAMPLE_MODELS / model / "config.pbtxt").read_text()
    if not batching:
        config = config.replace("dynamic_batching { }\n", "")
    (target / "config.pbtxt").write_text(config)
    return target.parent


async def served(server: ServerProcess, model: str, setup: str, duration: float) -> list[Row]:
    x = np.random.default_rng(0).standard_normal((1, *MODELS[model]), dtype=np.float32)
    name = "image" if model == "resnet18" else "input"
    request = build_request(model, {name: x})
    options = [("grpc.max_receive_message_length", 64 << 20)]
    rows = []
    async with grpc.aio.insecure_channel(server.address, options=options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for concurrency in CONCURRENCY:
            await closed_loop(stub, request, concurrency, min(duration / 4, 2.0))
            before = await _executions(stub, model)
            latencies = await closed_loop(stub, request, concurrency, duration)
            executions = await _executions(stub, model) - before
            pids = [server.process.pid, *(i.pid for i in server.instances(model))]
            rate = len(latencies) / duration
            rows.append(
                Row(
                    model,
                    setup,
                    concurrency,
                    round(rate, 1),
                    **percentiles_ms(latencies),
                    mean_batch=round(len(latencies) / max(executions, 1), 2),
                    rss_mb=round(rss_bytes(pids) / 2**20, 1),
                )
            )
            print(
                f"  {setup:<12} {model} c={concurrency:<3} {rate:>9.1f} rows/s "
                f"(mean batch {rows[-1].mean_batch})",
                flush=True,
            )
    return rows


async def _executions(stub: Any, model: str) -> int:
    response = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))
    return int(sum(m.execution_count for m in response.model_stats))


def summary(rows: list[Row]) -> str:
    lines = [
        f"{'model':<9} {'setup':<12} {'conc':>4} {'rows/s':>9} {'p50 ms':>8} {'p90 ms':>8} "
        f"{'p99 ms':>8} {'batch':>6} {'RSS MB':>7}"
    ]
    for r in rows:
        lines.append(
            f"{r.model:<9} {r.setup:<12} {r.concurrency:>4} {r.rows_per_s:>9.1f} {r.p50_ms:>8.1f} "
            f"{r.p90_ms:>8.1f} {r.p99_ms:>8.1f} {r.mean_batch:>6.1f} {r.rss_mb:>7.0f}"
        )
    lines.append("")
    for model in dict.fromkeys(r.model for r in rows):
        raw = {r.concurrency: r for r in rows if r.model == model and r.setup == "raw"}
        on = {r.concurrency: r for r in rows if r.model == model and r.setup == "batching-on"}
        off = {r.concurrency: r for r in rows if r.model == model and r.setup == "batching-off"}
        top = max(CONCURRENCY)
        formed = on[top].mean_batch
        nearest = min(raw, key=lambda b: abs(b - formed))
        speedup = on[top].rows_per_s / off[top].rows_per_s
        of_raw = on[top].rows_per_s / raw[nearest].rows_per_s
        lines.append(
            f"{model}: batching on / off at c={top}: {speedup:.2f}x; served (batching on, "
            f"c={top}, mean batch {formed:.1f}) / raw predictor at batch {nearest}: {of_raw:.2f}x"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", type=Path, default=Path("bench-results/batching.json"))
    args = parser.parse_args()
    rows: list[Row] = []
    for model in args.models:
        if not (EXAMPLE_MODELS / model / "1").is_dir():
            raise SystemExit(f"model {model} is not exported; run `make models-bench`")
        print(f"{model}: raw predictor", flush=True)
        sizes = [1, 2, 4, 8, 16] if model == "resnet18" else [1, 4, 8, 16, 32, 64]
        rows += raw_predictor(model, sizes, args.duration / 2)
        with tempfile.TemporaryDirectory() as tmp:
            for batching in (False, True):
                setup = "batching-on" if batching else "batching-off"
                print(f"{model}: server, {setup} (starting)", flush=True)
                repo = repository(Path(tmp), model, batching)
                server = ServerProcess(repo, Path(tmp) / f"{setup}.log", ["--no-h3"])
                try:
                    server.wait_ready()
                    rows += asyncio.run(served(server, model, setup, args.duration))
                finally:
                    server.stop()
    print()
    print(summary(rows))
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
