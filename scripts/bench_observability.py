"""`make bench-observability`: what metrics and tracing cost, on vs off, in one run.

The same closed-loop ModelInfer load (`mlp`, HTTP/2, 64 concurrent calls) against a server
with metrics and tracing off, and one with metrics on and tracing sampled at 1% (spans to the
console exporter, whose output goes to the server log). Throughput and latency as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from scripts.bench_common import closed_loop, percentiles_ms, write_json
from tests.servers import ServerProcess, model_repository

SETUPS = {
    "off": ["--no-metrics"],
    "metrics+tracing 1%": ["--trace-console", "--trace-sample-ratio", "0.01"],
}


@dataclass
class Row:
    setup: str
    requests_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float


async def load(server: ServerProcess, concurrency: int, duration: float) -> list[float]:
    request = build_request("mlp", {"input": np.ones((1, 256), np.float32)})
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await closed_loop(stub, request, concurrency, 1.0)
        return await closed_loop(stub, request, concurrency, duration)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2, help="alternate the setups this often")
    parser.add_argument("--out", type=Path, default=Path("bench-results/observability.json"))
    args = parser.parse_args()
    latencies: dict[str, list[float]] = {name: [] for name in SETUPS}
    seconds = dict.fromkeys(SETUPS, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        repo = model_repository(Path(tmp) / "models", ["mlp"])
        for round_number in range(args.rounds):
            for name, flags in SETUPS.items():
                print(f"round {round_number + 1}: {name}", flush=True)
                log = Path(tmp) / f"{len(latencies[name])}-{name[:3]}.log"
                server = ServerProcess(repo, log, ["--no-h3", *flags])
                try:
                    server.wait_ready()
                    latencies[name] += asyncio.run(load(server, 64, args.duration))
                    seconds[name] += args.duration
                finally:
                    server.stop()
    rows = [
        Row(name, round(len(values) / seconds[name], 1), **percentiles_ms(values))
        for name, values in latencies.items()
    ]
    base = rows[0].requests_per_s
    print(f"\n{'setup':<20} {'req/s':>8} {'ratio':>6} {'p50 ms':>7} {'p99 ms':>7}")
    for row in rows:
        print(
            f"{row.setup:<20} {row.requests_per_s:>8.1f} {row.requests_per_s / base:>6.3f} "
            f"{row.p50_ms:>7.2f} {row.p99_ms:>7.2f}"
        )
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
