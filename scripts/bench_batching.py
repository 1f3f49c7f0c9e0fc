"""`make bench`: the served model against the engine alone, at the batch sizes the server
actually formed, in one run.

For `resnet18` and `mlp_wide` a closed loop of single-row requests runs at concurrency 1, 8 and
64 against a server with dynamic batching. After each measurement, the raw predictor (in this
process, configured as the server's workers are, with nothing else running) runs every batch
size the server formed in that measurement, at a fixed shape; weighted by how often each size
was formed, that is the engine's own rows/s for the same work. For `mlp_wide` at the highest
concurrency a second server without dynamic batching is measured in the same rounds, and the
engine alone runs batch sizes drawn from 1..64 padded to the buckets and unpadded. Machines
are noisy (other work shares the CPUs), so every ratio is taken within one round and the rounds
alternate: the table reports the median ratio and its range.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf import text_format

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.inference import model_config_pb2 as mc
from scripts.bench_common import (
    closed_loop,
    finish,
    median_range,
    percentiles_ms,
    rounds_parser,
    rss_bytes,
    worker_predictor,
)
from tests.servers import EXAMPLE_MODELS, ServerProcess

MODELS = {"resnet18": ("image", (3, 224, 224)), "mlp_wide": ("input", (2048,))}
CONCURRENCY = (1, 8, 64)
OFF_MODEL, OFF_CONCURRENCY = "mlp_wide", 64
RANDOM_SIZES = 64  # the engine alone on batch sizes drawn from 1..64, padded or not


@dataclass
class Row:
    model: str
    setup: str  # batching-on, batching-off; engine-padded, engine-unpadded (random sizes)
    concurrency: int
    round: int
    rows_per_s: float
    p50_ms: float
    p99_ms: float
    mean_batch: float  # rows per execution, as formed (before padding to a bucket)
    raw_rows_per_s: float  # the engine alone at the same batch sizes
    rss_mb: float


class RawPredictor:
    """The engine alone: a worker's predictor (same class, same config) in this process."""

    def __init__(self, model: str, config: mc.ModelConfig, buckets: bool = True) -> None:
        from service.model.shapes import shape_buckets

        if not buckets:
            config.parameters["batch_buckets"].string_value = "none"
        self.shapes = shape_buckets(config)
        self.model = worker_predictor(EXAMPLE_MODELS / model, config)
        self.input, self.shape = MODELS[model]
        self.outputs = tuple(o.name for o in self.model.outputs)

    def seconds_per_batch(self, size: int, duration: float) -> float:
        x = np.random.default_rng(0).standard_normal((size, *self.shape), dtype=np.float32)
        for _ in range(2):  # builds this shape's kernels
            self.model.run({self.input: x}, self.outputs)
        runs, started = 0, time.perf_counter()
        while runs < 3 or time.perf_counter() - started < duration:
            self.model.run({self.input: x}, self.outputs)
            runs += 1
        return (time.perf_counter() - started) / runs

    def random_batches(self, duration: float) -> float:
        """Rows/s with batch sizes drawn from 1..RANDOM_SIZES, as a dynamic batcher forms
        them, each padded to this predictor's batch bucket (if it has buckets)."""
        rng = np.random.default_rng(1)
        x = rng.standard_normal((max((RANDOM_SIZES, *self.shapes.batch)), *self.shape))
        x = x.astype(np.float32)
        rows, started = 0, time.perf_counter()
        while time.perf_counter() - started < duration:
            size = int(rng.integers(1, RANDOM_SIZES + 1))
            self.model.run({self.input: x[: self.shapes.batch_rows(size)]}, self.outputs)
            rows += size
        return rows / (time.perf_counter() - started)

    def rows_per_s(self, formed: Counter[int], duration: float) -> float:
        """Rows/s of the engine running the batches the server formed, as often as it did."""
        budget = duration / max(len(formed), 1)
        seconds = sum(n * self.seconds_per_batch(s, budget) for s, n in formed.items())
        return sum(n * s for s, n in formed.items()) / seconds


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


async def executions(stub: Any, model: str) -> Counter[int]:
    response = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))
    return Counter(
        {
            int(b.batch_size): int(b.compute_infer.count)
            for m in response.model_stats
            for b in m.batch_stats
        }
    )


async def measure(
    server: ServerProcess, model: str, concurrency: int, duration: float
) -> tuple[float, list[float], Counter[int], float]:
    """rows/s, latencies, batch sizes formed, RSS of the server and its workers (MB)."""
    name, shape = MODELS[model]
    x = np.random.default_rng(0).standard_normal((1, *shape), dtype=np.float32)
    request = build_request(model, {name: x})
    options = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(server.address, options=options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await closed_loop(stub, request, concurrency, min(duration / 4, 1.0))
        before = await executions(stub, model)
        started = time.perf_counter()
        latencies = await closed_loop(stub, request, concurrency, duration)
        seconds = time.perf_counter() - started
        formed = await executions(stub, model)
        formed.subtract(before)
    pids = [server.process.pid, *(i.pid for i in server.instances(model))]
    return len(latencies) / seconds, latencies, +formed, rss_bytes(pids) / 2**20


def run_model(model: str, rounds: int, duration: float, root: Path) -> list[Row]:
    text = (EXAMPLE_MODELS / model / "config.pbtxt").read_text()
    raw = RawPredictor(model, text_format.Parse(text, mc.ModelConfig()))
    unpadded = None
    if model == OFF_MODEL:
        unpadded = RawPredictor(model, text_format.Parse(text, mc.ModelConfig()), buckets=False)
    setups = {"batching-on": True} | ({"batching-off": False} if model == OFF_MODEL else {})
    servers = {
        setup: ServerProcess(repository(root, model, on), root / f"{setup}.log", ["--no-h3"])
        for setup, on in setups.items()
    }
    rows = []
    try:
        for server in servers.values():
            server.wait_ready()
        for index in range(rounds):
            plan = [("batching-on", c) for c in CONCURRENCY]
            if model == OFF_MODEL:
                plan.append(("batching-off", OFF_CONCURRENCY))
            for setup, concurrency in plan:
                rate, latencies, formed, rss = asyncio.run(
                    measure(servers[setup], model, concurrency, duration)
                )
                reference = raw.rows_per_s(formed, duration / 2)
                mean = sum(n * s for s, n in formed.items()) / max(sum(formed.values()), 1)
                ms = percentiles_ms(latencies)
                rows.append(
                    Row(
                        model,
                        setup,
                        concurrency,
                        index,
                        round(rate, 1),
                        ms["p50_ms"],
                        ms["p99_ms"],
                        round(mean, 2),
                        round(reference, 1),
                        round(rss, 1),
                    )
                )
                print(
                    f"  round {index} {setup:<12} {model} c={concurrency:<3} {rate:>8.1f} rows/s"
                    f" (mean batch {mean:.1f}); raw at those sizes {reference:>8.1f} rows/s",
                    flush=True,
                )
            if unpadded is not None:
                for setup, predictor in (("engine-padded", raw), ("engine-unpadded", unpadded)):
                    rate = predictor.random_batches(duration)
                    rows.append(Row(model, setup, 0, index, round(rate, 1), 0, 0, 0, 0, 0))
                    print(f"  round {index} {setup:<15} {model} {rate:>8.1f} rows/s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return rows


def summary(rows: list[Row]) -> str:
    lines = [
        f"{'model':<9} {'setup':<12} {'conc':>4} {'rows/s':>8} {'batch':>6} {'raw rows/s':>10} "
        f"{'served/raw':>20} {'p50 ms':>7} {'p99 ms':>7} {'RSS MB':>7}"
    ]
    groups: dict[tuple[str, str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.model, r.setup, r.concurrency), []).append(r)
    engine = {k: v for k, v in groups.items() if k[1].startswith("engine-")}
    for (model, setup, concurrency), group in groups.items():
        if (model, setup, concurrency) in engine:
            continue
        lines.append(
            f"{model:<9} {setup:<12} {concurrency:>4} "
            f"{statistics.median(r.rows_per_s for r in group):>8.1f} "
            f"{statistics.median(r.mean_batch for r in group):>6.1f} "
            f"{statistics.median(r.raw_rows_per_s for r in group):>10.1f} "
            f"{median_range([r.rows_per_s / r.raw_rows_per_s for r in group]):>20} "
            f"{statistics.median(r.p50_ms for r in group):>7.1f} "
            f"{statistics.median(r.p99_ms for r in group):>7.1f} "
            f"{max(r.rss_mb for r in group):>7.0f}"
        )
    on = groups.get((OFF_MODEL, "batching-on", OFF_CONCURRENCY), [])
    off = groups.get((OFF_MODEL, "batching-off", OFF_CONCURRENCY), [])
    if on and off:
        ratios = [a.rows_per_s / b.rows_per_s for a, b in zip(on, off, strict=True)]
        lines.append(
            f"\n{OFF_MODEL} at c={OFF_CONCURRENCY}: batching on / off {median_range(ratios)}"
        )
    padded = engine.get((OFF_MODEL, "engine-padded", 0), [])
    unpadded = engine.get((OFF_MODEL, "engine-unpadded", 0), [])
    if padded and unpadded:
        ratios = [a.rows_per_s / b.rows_per_s for a, b in zip(padded, unpadded, strict=True)]
        lines.append(
            f"{OFF_MODEL} engine alone, batch sizes drawn from 1..{RANDOM_SIZES}: padded to "
            f"buckets {statistics.median(r.rows_per_s for r in padded):.1f} rows/s, unpadded "
            f"{statistics.median(r.rows_per_s for r in unpadded):.1f} rows/s: "
            f"{median_range(ratios)}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = rounds_parser(__doc__, "batching.json")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    rows: list[Row] = []
    for model in args.models:
        if not (EXAMPLE_MODELS / model / "1").is_dir():
            raise SystemExit(f"model {model} is not exported; run `make models-bench`")
        print(f"{model}: starting the server(s)", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            rows += run_model(model, args.rounds, args.duration, Path(tmp))
    return finish(summary(rows), args.out, rows)


if __name__ == "__main__":
    raise SystemExit(main())
