"""What the benchmarks share: a closed-loop load generator, process measurements, output."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from protos.inference import model_config_pb2 as mc
    from service.backend.paddle_model import PaddleModel


async def closed_loop(stub: Any, request: Any, concurrency: int, duration: float) -> list[float]:
    """`concurrency` clients each send ModelInfer again as soon as the last answer came;
    returns every call's latency in seconds."""
    end = time.perf_counter() + duration
    latencies: list[float] = []

    async def client() -> None:
        while (start := time.perf_counter()) < end:
            await stub.ModelInfer(request, timeout=120)
            latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


def percentiles_ms(latencies: Sequence[float]) -> dict[str, float]:
    values = np.asarray(latencies) * 1e3
    return {f"p{p}_ms": round(float(np.percentile(values, p)), 2) for p in (50, 90, 99)}


def median_range(ratios: Sequence[float]) -> str:
    """Ratios taken within rounds, as the tables give them: the median and its range."""
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def process_cpu_seconds(pid: int) -> float:
    """CPU time of the process's threads, to the nanosecond (schedstat): /proc/PID/stat counts
    in clock ticks (10 ms), too coarse for short measurements. Threads that already exited are
    not counted; the servers measured keep theirs."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread just exited
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def stat_cpu_seconds(pid: int) -> float:
    """User and system CPU time of the process from /proc/PID/stat, in clock ticks (10 ms):
    coarser than process_cpu_seconds, but it keeps the time of threads that already exited,
    which servers with thread pools that come and go (MLServer's, grpcio's) spend."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


FRONTEND_MODULE = "service.frontends.frontend"  # in a paddlequic front-end's command line


def tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """Each process of a server's tree: its part (main, frontends, workers: every other
    process, launchers included) and its CPU seconds (/proc/PID/stat)."""
    # Imported here: MLServer's process imports this module for worker_predictor
    # (scripts/peers/mlserver_runtime.py), where tests.servers' protos, of the same `inference`
    # package as MLServer's own, would fail to load (duplicate symbol).
    from tests.servers import descendants

    parts = {root: "main"} | {
        pid: "frontends" if FRONTEND_MODULE in command else "workers"
        for pid, command in descendants(root).items()
    }
    cpu = {}
    for pid, part in parts.items():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            cpu[pid] = (part, stat_cpu_seconds(pid))
    return cpu


def cpu_spent(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds each part of a server's tree (tree_cpu) spent between two readings."""
    spent = dict.fromkeys(("main", "frontends", "workers"), 0.0)
    for pid, (part, cpu) in after.items():
        spent[part] += cpu - before.get(pid, (part, 0.0))[1]
    return spent


def worker_predictor(directory: Path, config: mc.ModelConfig | None = None) -> PaddleModel:
    """The Paddle predictor a CPU worker makes for the model in `directory` (its config.pbtxt,
    or `config`, and version 1): same class, same config, in this process."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    # As in the server's CPU workers: one OpenMP thread per math thread.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore", message="No ccache found")
    from google.protobuf import text_format

    from protos.inference import model_config_pb2 as mc
    from service.backend.load import Load
    from service.backend.paddle_model import PaddleModel
    from service.model.parameters import string_parameters
    from service.model.shapes import shape_buckets

    if config is None:
        config = text_format.Parse((directory / "config.pbtxt").read_text(), mc.ModelConfig())
    version = directory / "1"
    files = (str(version / "inference.json"), str(version / "inference.pdiparams"))
    load = Load(
        config.name,
        1,
        *files,
        string_parameters(config),
        "cpu",
        shape_buckets(config),
        config=config.SerializeToString(),
    )
    return PaddleModel(load)


def rss_bytes(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def round_ratios(rows: Sequence[Any], way: str, reference: str, field: str) -> list[float]:
    """`field` of `way` over that of `reference`, within each round (rows with `round` and
    `way`), in round order."""
    by_round: dict[int, dict[str, Any]] = {}
    for row in rows:
        by_round.setdefault(row.round, {})[row.way] = row
    return [
        getattr(ways[way], field) / getattr(ways[reference], field)
        for _, ways in sorted(by_round.items())
    ]


def write_json(path: Path, rows: Sequence[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = [asdict(r) if is_dataclass(r) and not isinstance(r, type) else r for r in rows]
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nwrote {path}")


def rounds_parser(description: str | None, out: str) -> argparse.ArgumentParser:
    """What every benchmark of alternating rounds takes: their number and length, and where
    its JSON goes (`out`, under bench-results/)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median)")
    parser.add_argument("--out", type=Path, default=Path("bench-results") / out)
    return parser


def finish(summary: str, out: Path, rows: Sequence[Any]) -> int:
    """The summary printed after the rounds' lines, the rows written as JSON."""
    print()
    print(summary)
    write_json(out, rows)
    return 0


def round_options(parser: argparse.ArgumentParser, servers: Sequence[str]) -> None:
    """What every benchmark of alternating rounds against peers takes."""
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median)")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per measurement")
    parser.add_argument(
        "--clients", type=int, default=2, help="client processes generating the load"
    )
    parser.add_argument(
        "--servers", default=",".join(servers), help=f"comma-separated, of {','.join(servers)}"
    )
    parser.add_argument(
        "--frontends", type=int, default=1, help="paddlequic's --frontends (1: one process)"
    )


def begin_rounds(clients: int, rounds: int, duration: float, per: str) -> None:
    """A TERM (a timeout, a CI runner) stops the servers on the way out, as Ctrl-C does; then
    what shares the cores, said once."""
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    cores = len(os.sched_getaffinity(0))
    print(
        f"{clients} client processes, the servers and this script share {cores} cores "
        f"(load average {os.getloadavg()[0]:.1f}); {rounds} rounds of {duration:g} s per {per}",
        flush=True,
    )
