"""`make bench-sequences`: the stateful `kws` example (a GRU keyword spotter whose state the
server carries between a sequence's requests) at 1, 16 and 64 live sequences, against its
engine alone in the same run.

Served: N clients each run sequences of LENGTH chunks back to back, one request at a time
(each waits for its answer, as a streaming recognizer does), so N sequences are live at once;
the sequence batcher batches the requests of different sequences. Reference, in this process
with the same predictor class and config as the server's workers: the N sequences stepped
together (one batch of N rows per step, the state carried by hand), the best any scheduler
can do, and one row at a time, what a server without sequence batching would run. Rounds
alternate and every ratio is taken within one round: the table gives the median and range.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clients.inference_client import AsyncInferenceClient
from scripts.bench_common import (
    finish,
    median_range,
    percentiles_ms,
    process_cpu_seconds,
    rounds_parser,
    worker_predictor,
)
from tests.servers import EXAMPLE_MODELS, ServerProcess, model_repository

MODEL = "kws"
LIVE = (1, 16, 64)
LENGTH = 20  # chunks per sequence (8 frames each: 0.8 s of 10 ms frames)
FRAMES, FEATURES, STATE = 8, 40, 64
TRANSPORTS = ("h2", "h3")

Array = np.ndarray[Any, Any]


@dataclass
class Row:
    transport: str  # h2, h3; engine for the reference
    live: int
    round: int
    requests_per_s: float
    sequences_per_s: float
    p50_ms: float
    p99_ms: float
    server_cpu_us_per_request: float
    engine_batched_per_s: float  # the engine alone: `live` sequences stepped as one batch
    engine_single_per_s: float  # the engine alone: one row at a time


class Engine:
    """kws's predictor as a worker runs it (same class, same config), in this process."""

    def __init__(self) -> None:
        self.model = worker_predictor(EXAMPLE_MODELS / MODEL)
        self.outputs = tuple(o.name for o in self.model.outputs)

    def steps_per_s(self, rows: int, duration: float) -> float:
        """Sequence steps per second, `rows` sequences stepped together, state carried."""
        rng = np.random.default_rng(0)
        features = rng.standard_normal((rows, FRAMES, FEATURES), dtype=np.float32)
        state = np.zeros((rows, STATE), np.float32)
        start = np.zeros((rows, 1), np.float32)
        inputs = {"features": features, "start": start, "gru_state": state}
        self.model.run(inputs, self.outputs)  # this shape's kernels are built: not counted
        steps, end = 0, time.perf_counter() + duration
        while time.perf_counter() < end:
            outputs, _ = self.model.run(
                {"features": features, "start": start, "gru_state": state}, self.outputs
            )
            state = outputs[self.outputs[1]]
            steps += rows
        return steps / duration


async def served(
    server: ServerProcess, transport: str, certs: Path, live: int, duration: float
) -> tuple[int, int, list[float], float, float]:
    """(requests, sequences completed, latencies, server CPU seconds, seconds) of `live`
    clients each running sequences back to back for `duration` (each finishes its sequence)."""
    url = server.url if transport == "h2" else f"h3://localhost:{server.port}"
    ca = None if transport == "h2" else str(certs / "ca.pem")
    chunk = np.random.default_rng(1).standard_normal((1, FRAMES, FEATURES), dtype=np.float32)
    latencies: list[float] = []
    completed = 0
    async with AsyncInferenceClient(url, ca_file=ca) as client:
        end = time.perf_counter() + duration

        async def run() -> None:
            nonlocal completed
            while time.perf_counter() < end:
                sequence = client.sequence(MODEL)
                for index in range(LENGTH):
                    began = time.perf_counter()
                    await sequence.infer({"features": chunk}, end=index == LENGTH - 1)
                    latencies.append(time.perf_counter() - began)
                completed += 1

        await asyncio.gather(*(run() for _ in range(min(live, 2))))  # warm up, not counted
        latencies.clear()
        completed = 0
        began = time.perf_counter()
        end = began + duration
        cpu = process_cpu_seconds(server.process.pid)
        await asyncio.gather(*(run() for _ in range(live)))
        cpu = process_cpu_seconds(server.process.pid) - cpu
        elapsed = time.perf_counter() - began
    return len(latencies), completed, latencies, cpu, elapsed


def measure(rounds: int, duration: float, root: Path) -> list[Row]:
    certs = root / "certs"
    repository = model_repository(root / "models", [MODEL])
    server = ServerProcess(repository, root / "server.log", ["--certs-dir", str(certs)])
    engine = Engine()
    rows: list[Row] = []
    try:
        server.wait_ready()
        for index in range(rounds):
            for live in LIVE:
                batched = engine.steps_per_s(live, duration / 4)
                single = engine.steps_per_s(1, duration / 4)
                for transport in TRANSPORTS if index % 2 == 0 else reversed(TRANSPORTS):
                    requests, sequences, latencies, cpu, elapsed = asyncio.run(
                        served(server, transport, certs, live, duration)
                    )
                    ms = percentiles_ms(latencies)
                    row = Row(
                        transport,
                        live,
                        index,
                        round(requests / elapsed, 1),
                        round(sequences / elapsed, 2),
                        ms["p50_ms"],
                        ms["p99_ms"],
                        round(cpu / max(requests, 1) * 1e6, 1),
                        round(batched, 1),
                        round(single, 1),
                    )
                    rows.append(row)
                    print(
                        f"  round {index} {transport} live={live:<3} {row.requests_per_s:>8.1f}"
                        f" req/s {row.sequences_per_s:>6.2f} seq/s p50 {row.p50_ms:.1f} ms"
                        f" p99 {row.p99_ms:.1f} ms; engine {batched:.0f} steps/s batched,"
                        f" {single:.0f} one at a time",
                        flush=True,
                    )
    finally:
        server.stop()
    return rows


def summary(rows: list[Row]) -> str:
    lines = [
        f"{'transport':<9} {'live':>4} {'req/s':>8} {'seq/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'cpu us/req':>10} {'served/engine batched':>22} {'served/engine single':>21}"
    ]
    groups: dict[tuple[str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.transport, r.live), []).append(r)
    for (transport, live), group in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(
            f"{transport:<9} {live:>4} "
            f"{statistics.median(r.requests_per_s for r in group):>8.1f} "
            f"{statistics.median(r.sequences_per_s for r in group):>7.2f} "
            f"{statistics.median(r.p50_ms for r in group):>7.1f} "
            f"{statistics.median(r.p99_ms for r in group):>7.1f} "
            f"{statistics.median(r.server_cpu_us_per_request for r in group):>10.0f} "
            f"{median_range([r.requests_per_s / r.engine_batched_per_s for r in group]):>22} "
            f"{median_range([r.requests_per_s / r.engine_single_per_s for r in group]):>21}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = rounds_parser(__doc__, "sequences.json")
    args = parser.parse_args()
    logging.getLogger("quic").setLevel(logging.WARNING)  # importing paddle logs INFO to stderr
    if not (EXAMPLE_MODELS / MODEL / "1").is_dir():
        raise SystemExit(f"model {MODEL} is not exported; run `make models`")
    print(f"{MODEL}: starting the server", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args.rounds, args.duration, Path(tmp))
    return finish(summary(rows), args.out, rows)


if __name__ == "__main__":
    raise SystemExit(main())
