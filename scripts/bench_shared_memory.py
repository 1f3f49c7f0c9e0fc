"""`make bench`'s shared-memory row: resnet18, batch 8 per request (4.8 MB of input), the same
requests with their tensors in system shared memory against carried as raw bytes, in one run.

A closed loop of CONCURRENCY clients on one HTTP/2 connection; the rounds alternate raw and
shared memory, each ratio is taken within its round. Front-end CPU is the server's main
process (the worker's is the same either way: the same batches run)."""

from __future__ import annotations

import asyncio
import secrets
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from scripts.bench_common import (
    closed_loop,
    finish,
    median_range,
    process_cpu_seconds,
    round_ratios,
    rounds_parser,
)
from service.inference.shared_memory import SHM_DIR
from tests.servers import EXAMPLE_MODELS, ServerProcess, model_repository

MODEL, INPUT, OUTPUT = "resnet18", "image", "logits"
ROWS = 8
CONCURRENCY = 4
WAYS = ("raw", "shared-memory")


@dataclass
class Row:
    way: str
    round: int
    requests_per_s: float
    frontend_cpu_us_per_request: float


def requests(regions: list[str], image: np.ndarray[Any, Any]) -> dict[str, Any]:
    """The same request both ways; the shared-memory one names `regions` (in, out)."""
    raw = build_request(MODEL, {INPUT: image}, [OUTPUT])
    shared = pb.ModelInferRequest(model_name=MODEL)
    tensor = shared.inputs.add(name=INPUT, datatype="FP32", shape=image.shape)
    tensor.parameters["shared_memory_region"].string_param = regions[0]
    tensor.parameters["shared_memory_byte_size"].int64_param = image.nbytes
    output = shared.outputs.add(name=OUTPUT)
    output.parameters["shared_memory_region"].string_param = regions[1]
    output.parameters["shared_memory_byte_size"].int64_param = ROWS * 1000 * 4
    return {"raw": raw, "shared-memory": shared}


async def measure(server: ServerProcess, rounds: int, duration: float) -> list[Row]:
    image = np.random.default_rng(0).standard_normal((ROWS, 3, 224, 224), dtype=np.float32)
    keys = [f"pq-bench-{secrets.token_hex(4)}" for _ in range(2)]
    (Path(SHM_DIR) / keys[0]).write_bytes(image.tobytes())
    (Path(SHM_DIR) / keys[1]).write_bytes(bytes(ROWS * 1000 * 4))
    rows: list[Row] = []
    options = [("grpc.max_send_message_length", 64 << 20)]
    try:
        async with grpc.aio.insecure_channel(server.address, options=options) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for name, key in zip(("bench-in", "bench-out"), keys, strict=True):
                size = (Path(SHM_DIR) / key).stat().st_size
                await stub.SystemSharedMemoryRegister(
                    pb.SystemSharedMemoryRegisterRequest(name=name, key="/" + key, byte_size=size)
                )
            calls = requests(["bench-in", "bench-out"], image)
            for way in WAYS:  # warm up both ways (kernels, connections), not counted
                await closed_loop(stub, calls[way], CONCURRENCY, 1.0)
            for index in range(rounds):
                for way in WAYS if index % 2 == 0 else reversed(WAYS):
                    cpu = process_cpu_seconds(server.process.pid)
                    latencies = await closed_loop(stub, calls[way], CONCURRENCY, duration)
                    cpu = process_cpu_seconds(server.process.pid) - cpu
                    row = Row(
                        way,
                        index,
                        round(len(latencies) / duration, 1),
                        round(cpu / max(len(latencies), 1) * 1e6, 1),
                    )
                    rows.append(row)
                    print(
                        f"  round {index} {way:<13} {row.requests_per_s:>7.1f} req/s, "
                        f"front-end {row.frontend_cpu_us_per_request:>8.0f} us CPU per request",
                        flush=True,
                    )
    finally:
        for key in keys:
            (Path(SHM_DIR) / key).unlink(missing_ok=True)
    return rows


def summary(rows: list[Row]) -> str:
    speed = round_ratios(rows, "shared-memory", "raw", "requests_per_s")
    cpu = round_ratios(rows, "shared-memory", "raw", "frontend_cpu_us_per_request")
    lines = [f"{'way':<13} {'req/s':>8} {'front-end CPU us/req':>21}"]
    for way in WAYS:
        group = [r for r in rows if r.way == way]
        lines.append(
            f"{way:<13} {statistics.median(r.requests_per_s for r in group):>8.1f} "
            f"{statistics.median(r.frontend_cpu_us_per_request for r in group):>21.0f}"
        )
    lines.append(
        f"{MODEL} batch {ROWS}, shared memory / raw: requests/s {median_range(speed)}, "
        f"front-end CPU per request {median_range(cpu)} "
        "(goal: requests/s at least 1.5x or CPU at most 0.5x)"
    )
    return "\n".join(lines)


def main() -> int:
    parser = rounds_parser(__doc__, "shared_memory.json")
    args = parser.parse_args()
    if not (EXAMPLE_MODELS / MODEL / "1").is_dir():
        raise SystemExit(f"model {MODEL} is not exported; run `make models`")
    print(f"{MODEL}: starting the server", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        repository = model_repository(Path(tmp) / "models", [MODEL])
        server = ServerProcess(repository, Path(tmp) / "server.log", ["--no-h3"])
        try:
            server.wait_ready()
            rows = asyncio.run(measure(server, args.rounds, args.duration))
        finally:
            server.stop()
    return finish(summary(rows), args.out, rows)


if __name__ == "__main__":
    raise SystemExit(main())
