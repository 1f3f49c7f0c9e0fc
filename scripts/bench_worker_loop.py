"""`make bench-worker-loop`: what a worker batching from its own queues (--instance-queues)
spends per batch beyond the predictor's own run, at batch sizes of 1, 8 and 32 one-row
requests, in this one process (no server, no sockets): the predictor alone, the worker's loop
around it (taking each request's record, forming the batch, running it, writing each answer),
and the server's side of the records (writing each request, reading each answer), each CPU
time per batch and as a ratio to the predictor's, and the predictor's run inside the loop (the
same run, its caches colder between the worker's batches). The requests come in one form (the
worker reads them as one run), then in two forms taking turns (two priorities: every run is one
request, the worker's worst case). Rounds alternate and the table gives the median and range;
issue #43's goal is the worker at most 1.5x the predictor's own."""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import text_format

from protos.inference import model_config_pb2 as mc
from scripts.bench_common import median_range, worker_predictor, write_json
from service.batching.batcher import policy_from_config
from service.queues import records, replies
from service.queues.layout import QueueLayout
from service.workers import protocol
from service.workers.queued_loop import PARENT
from service.workers.queued_worker import QueuedWorker
from tests.servers import EXAMPLE_MODELS

MODEL = "mlp"
BATCHES = (1, 8, 32)
FORMS = (1, 2)  # one form (one run per batch), two taking turns (a run per request)
RING_BYTES = 4 << 20


@dataclass
class Row:
    round: int
    forms: int  # request forms taking turns (priorities 1, 2, ...)
    batch: int
    predictor_us: float  # CPU per batch: the predictor's run alone
    worker_us: float  # CPU per batch: the worker's loop, the predictor's run included
    inside_us: float  # CPU per batch: the predictor's run inside the worker's loop
    caller_us: float  # CPU per batch: writing its requests, reading their answers


def _cpu_per(count: int, run: Callable[[], Any]) -> float:
    start = time.process_time()
    for _ in range(count):
        run()
    return (time.process_time() - start) / count * 1e6


def measure(
    model: Any, config: mc.ModelConfig, round_: int, forms: int, batch: int, runs: int
) -> Row:
    outputs = tuple(o.name for o in model.outputs)
    layout = QueueLayout(RING_BYTES, RING_BYTES, max(config.max_batch_size, 1))
    segment = mmap.mmap(-1, layout.size)
    setup = protocol.Queues(
        layout, policy_from_config(config, 1), (("input", "FP32"),), outputs[:1]
    )
    timed = _Timed(model)
    worker = QueuedWorker(timed, setup, str, (None, None))
    worker.add(PARENT, segment, os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK))
    requests, reply_ring, _ = layout.caller_end(memoryview(segment))
    rows = np.random.default_rng(batch).standard_normal((batch, 256), np.float32)
    row_bytes = [rows[i : i + 1].tobytes() for i in range(batch)]
    whole = {"input": rows}
    ids = iter(range(1, 1 << 62))
    expected = replies.Expected((0,), (4,), 1, max(config.max_batch_size, 1))

    def write() -> None:
        for index, data in enumerate(row_bytes):
            records.write_request(
                requests, next(ids), [(0, (1, 256), data)], (0,), 1 + index % forms, 1, None, None
            )

    def read() -> None:
        while (payload := reply_ring.take()) is not None:
            replies.read_reply(payload, lambda _: expected)

    def loop() -> None:
        worker.take()
        worker.step()
        worker.tell()

    for _ in range(20):  # warm: the predictor's caches, the rings' pages
        model.run(whole, outputs[:1])
        write()
        loop()
        read()
    predictor = _cpu_per(runs, lambda: model.run(whole, outputs[:1]))
    caller = worker_total = 0.0
    timed.cpu = 0.0
    for _ in range(runs):
        start = time.process_time()
        write()
        middle = time.process_time()
        loop()
        end = time.process_time()
        read()
        caller += (middle - start) + (time.process_time() - end)
        worker_total += end - middle
    for ring in (requests, reply_ring):
        ring.release()
    worker.drop(PARENT)
    scale = 1e6 / runs
    return Row(
        round_, forms, batch, predictor, worker_total * scale, timed.cpu * scale, caller * scale
    )


class _Timed:
    """The model, counting the CPU of its runs: run alone in a loop its code and weights stay
    in the core's caches; between the worker's batches they do not all (touching 2 MiB between
    runs doubled `mlp`'s), so its run inside the loop is the worker's floor, not its run alone."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.cpu = 0.0

    def run(self, inputs: Any, outputs: tuple[str, ...]) -> Any:
        start = time.process_time()
        try:
            return self._model.run(inputs, outputs)
        finally:
            self.cpu += time.process_time() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=300, help="batches per measurement")
    parser.add_argument("--out", type=Path, default=Path("bench-results/worker_loop.json"))
    args = parser.parse_args()
    config = text_format.Parse(
        (EXAMPLE_MODELS / MODEL / "config.pbtxt").read_text(), mc.ModelConfig()
    )
    model = worker_predictor(EXAMPLE_MODELS / MODEL)
    rows: list[Row] = []
    cases = [(forms, batch) for forms in FORMS for batch in BATCHES]
    for index in range(args.rounds):
        for forms, batch in cases[index % len(cases) :] + cases[: index % len(cases)]:
            row = measure(model, config, index, forms, batch, args.runs)
            rows.append(row)
            print(
                f"  round {index} forms {forms} batch {batch:>2}: predictor "
                f"{row.predictor_us:.0f} us, worker {row.worker_us:.0f} us, caller "
                f"{row.caller_us:.0f} us per batch",
                flush=True,
            )
    print(f"\n{MODEL}, one-row requests; CPU us per batch: median [lowest-highest] of rounds")
    print(
        f"{'forms':>5} {'batch':>5} {'predictor':>16} {'worker':>16} {'worker/predictor':>22} "
        f"{'inside the loop':>16} {'caller':>14}"
    )
    for forms, batch in cases:
        mine = [r for r in rows if (r.forms, r.batch) == (forms, batch)]

        def spread(values: list[float]) -> str:
            return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"

        ratio = median_range([r.worker_us / r.predictor_us for r in mine])
        print(
            f"{forms:>5} {batch:>5} {spread([r.predictor_us for r in mine]):>16} "
            f"{spread([r.worker_us for r in mine]):>16} {ratio:>22} "
            f"{spread([r.inside_us for r in mine]):>16} {spread([r.caller_us for r in mine]):>14}"
        )
    print(
        "predictor: its run alone, in a loop; inside the loop: the same run between the "
        "worker's batches, its caches colder"
    )
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
