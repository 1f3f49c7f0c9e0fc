"""`make bench-scale`: what `--frontends N` buys, in one run: ModelInfer requests/s, the same
requests in ModelStreamInfer streams (with front-ends, every stream still passes through the
parent), and new connections/s (handshake, one ModelInfer, close) on HTTP/2 and HTTP/3 against
servers with 1, 2 and 4 front-end processes, each figure also as a ratio to one front-end; the
CPU each call costs every process of the server (main, front-ends, workers), and the calls/s
that projects to on 16 and 64 cores. Rounds alternate the servers' order (each started afresh per
round); a table gives each figure's median over the rounds and each ratio's median and range,
the ratio taken within a round.

The load comes from several client processes (one Python process saturates long before a
server with several front-ends does), each with its own connections, so the kernel spreads
them over the front-ends. On a machine with few cores the clients and the server compete for
them: no gain is expected there; the table is for bigger hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from clients.inference_client import build_request
from clients.quic_channel import QuicChannel
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from scripts.bench_common import closed_loop, median_range, tree_cpu, write_json
from tests.servers import ServerProcess, model_repository

TRANSPORTS = ("h2", "h3")
WORKLOADS = ("ModelInfer", "ModelStreamInfer", "new connections")
# Each client process: this many connections for ModelInfer (and ModelStreamInfer: a stream
# on each), this many calls in flight on each; this many connections being opened at once for
# `new connections`.
CONNECTIONS_PER_CLIENT = 4
CALLS_PER_CONNECTION = 8
OPENERS_PER_CLIENT = 4
WARM_UP_S = 1.0
PROJECTED_CORES = (16, 64)
BENCH_MODELS = Path(__file__).resolve().parent / "bench_models"


# How calls reach the workers: the server's batcher, or the instances' own queues
# (--instance-queues: the worker batches).
PATHS = {"batcher": ["--no-instance-queues"], "queues": ["--instance-queues"]}


@dataclass(frozen=True)
class Setup:
    """One server of the run: its front-end processes and its path to the workers."""

    frontends: int
    path: str

    def __str__(self) -> str:
        return f"--frontends {self.frontends}" + (" queues" if self.path == "queues" else "")


@dataclass
class Measurement:
    round: int
    model: str
    frontends: int
    path: str
    transport: str
    workload: str
    count: int
    seconds: float
    per_second: float
    # CPU time per call or connection of each part of the server's process tree: the main
    # process (with front-ends: the parent, which runs the scheduler), the front-ends, and
    # the others (workers and their launchers); their sum; the busiest process that more
    # front-ends would not multiply (the parent or a worker).
    main_cpu_us: float
    frontends_cpu_us: float
    workers_cpu_us: float
    total_cpu_us: float
    busiest_cpu_us: float
    busiest: str
    # Calls or connections per second a host with that many cores would serve: its cores over
    # the summed CPU per item, capped by that busiest process (one process uses one core).
    projected: dict[str, int]


def open_channel(transport: str, port: int, ca_file: str) -> Any:
    if transport == "h2":
        # grpc shares connections between a process's channels unless told not to.
        options = [("grpc.use_local_subchannel_pool", 1)]
        return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
    return QuicChannel(f"localhost:{port}", ca_file=ca_file)


async def _on_connections(
    load: Callable[[Any, Any, int, float], Awaitable[int]],
    model: str,
    transport: str,
    port: int,
    ca_file: str,
    duration: float,
) -> int:
    """`load(stub, request, in flight, seconds)` on each of the client's connections, after a
    warm-up with one in flight: what they completed."""
    request = build_request(model, {"input": np.ones((1, 256), np.float32)})
    channels = [open_channel(transport, port, ca_file) for _ in range(CONNECTIONS_PER_CLIENT)]
    try:
        stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]
        await asyncio.gather(*(load(s, request, 1, WARM_UP_S) for s in stubs))
        done = await asyncio.gather(
            *(load(s, request, CALLS_PER_CONNECTION, duration) for s in stubs)
        )
        return sum(done)
    finally:
        for channel in channels:
            await channel.close()


async def unary_loop(stub: Any, request: Any, in_flight: int, duration: float) -> int:
    """ModelInfer calls, `in_flight` at once, each sent again as its answer comes: how many."""
    return len(await closed_loop(stub, request, in_flight, duration))


async def stream_loop(stub: Any, request: Any, in_flight: int, duration: float) -> int:
    """One ModelStreamInfer stream with `in_flight` requests in it, the next written as each
    answer comes, until `duration` has passed and every request is answered: how many were."""
    end = time.perf_counter() + duration
    call = stub.ModelStreamInfer(timeout=120)
    for _ in range(in_flight):
        await call.write(request)
    sent, answered = in_flight, 0
    async for response in call:
        if response.error_message:
            raise RuntimeError(response.error_message)
        answered += 1
        if time.perf_counter() < end:
            await call.write(request)
            sent += 1
        elif answered == sent:
            await call.done_writing()
    return answered


async def _connections(model: str, transport: str, port: int, ca_file: str, duration: float) -> int:
    request = build_request(model, {"input": np.ones((1, 256), np.float32)})
    end = time.perf_counter() + duration
    count = 0

    async def opener() -> None:
        nonlocal count
        while time.perf_counter() < end:
            channel = open_channel(transport, port, ca_file)
            try:
                await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
            finally:
                await channel.close()
            count += 1

    await asyncio.gather(*(opener() for _ in range(OPENERS_PER_CLIENT)))
    return count


def client(
    workload: str, model: str, transport: str, port: int, ca_file: str, duration: float
) -> int:
    """One client process's share of a measurement: calls or connections completed."""
    if workload == "new connections":
        return asyncio.run(_connections(model, transport, port, ca_file, duration))
    load = unary_loop if workload == "ModelInfer" else stream_loop
    return asyncio.run(_on_connections(load, model, transport, port, ca_file, duration))


@dataclass(frozen=True)
class Load:
    """What every measurement of a run shares."""

    clients: int
    model: str
    ca_file: Path
    duration: float


def measure(
    pool: ProcessPoolExecutor,
    load: Load,
    round_: int,
    setup: Setup,
    transport: str,
    workload: str,
    server: ServerProcess,
) -> Measurement:
    duration = load.duration
    jobs = [
        pool.submit(
            client, workload, load.model, transport, server.port, str(load.ca_file), duration
        )
        for _ in range(load.clients)
    ]
    # The clients warm up for a moment before their measured run; the CPU is read around it.
    time.sleep(WARM_UP_S if workload == "ModelInfer" else 0.0)
    before = tree_cpu(server.process.pid)
    count = sum(job.result() for job in jobs)
    after = tree_cpu(server.process.pid)
    result = per_item(
        round_, load.model, setup, transport, workload, count, duration, before, after
    )
    print(
        f"  round {round_} {setup} {transport} {workload:<16} {result.per_second:>9.1f}/s  "
        f"CPU each: {result.total_cpu_us:>6.0f} us in all, {result.main_cpu_us:.0f} main, "
        f"{result.frontends_cpu_us:.0f} front-ends, {result.workers_cpu_us:.0f} workers; "
        f"busiest {result.busiest} {result.busiest_cpu_us:.0f} us",
        flush=True,
    )
    return result


def per_item(
    round_: int,
    model: str,
    setup: Setup,
    transport: str,
    workload: str,
    count: int,
    duration: float,
    before: dict[int, tuple[str, float]],
    after: dict[int, tuple[str, float]],
) -> Measurement:
    """The CPU the tree spent between two readings, per call or connection, by part."""
    scale = 1e6 / max(count, 1)
    spent = {
        pid: (part, (cpu - before.get(pid, (part, 0.0))[1]) * scale)
        for pid, (part, cpu) in after.items()
    }
    parts = {
        name: sum(us for part, us in spent.values() if part == name)
        for name in ("main", "frontends", "workers")
    }
    total = sum(parts.values())
    # Front-ends multiply with the cores (--frontends N); the parent and each worker do not.
    single = [item for item in spent.values() if item[0] != "frontends"]
    busiest_part, busiest = max(single, key=lambda item: item[1], default=("main", 0.0))
    projected = {
        str(cores): round(min(cores / total, 1 / busiest) * 1e6 if total and busiest else 0.0)
        for cores in PROJECTED_CORES
    }
    return Measurement(
        round_,
        model,
        setup.frontends,
        setup.path,
        transport,
        workload,
        count,
        duration,
        round(count / duration, 1),
        round(parts["main"], 1),
        round(parts["frontends"], 1),
        round(parts["workers"], 1),
        round(total, 1),
        round(busiest, 1),
        busiest_part,
        projected,
    )


def _grid(
    title: str,
    setups: Sequence[Setup],
    cell: Callable[[Setup, str, str], str],
    results: Sequence[Measurement],
) -> str:
    """A row per workload measured and transport, a column per server."""
    header = f"{'workload':<16} {'transport':<9}" + "".join(f" {n!s:>36}" for n in setups)
    rows = [title, header]
    measured = {m.workload for m in results}
    for workload in [w for w in WORKLOADS if w in measured]:
        for transport in TRANSPORTS:
            cells = "".join(f" {cell(n, transport, workload):>36}" for n in setups)
            rows.append(f"{workload:<16} {transport:<9}{cells}")
    return "\n".join(rows)


Key = tuple[Setup, str, str]  # server, transport, workload


def _by_key(results: Sequence[Measurement]) -> dict[Key, list[Measurement]]:
    """Each figure's measurements, one per round, in round order."""
    by_key: dict[Key, list[Measurement]] = {}
    for m in sorted(results, key=lambda m: m.round):
        by_key.setdefault((Setup(m.frontends, m.path), m.transport, m.workload), []).append(m)
    return by_key


def _against_base(
    by_key: dict[Key, list[Measurement]],
    base: Key,
    key: Key,
    figure: Callable[[Measurement], float],
) -> str:
    """The figure's median over the rounds, and its ratio to the base's, round by round."""
    mine = by_key[key]
    ratios = [
        figure(m) / figure(b) if figure(b) else 0.0 for m, b in zip(mine, by_key[base], strict=True)
    ]
    return f"{statistics.median(figure(m) for m in mine):.0f} ({median_range(ratios)})"


def table(results: Sequence[Measurement], setups: Sequence[Setup]) -> str:
    """Each figure per second, and as a ratio to the first server's."""
    by_key = _by_key(results)

    def cell(n: Setup, transport: str, workload: str) -> str:
        base = (setups[0], transport, workload)
        return _against_base(by_key, base, (n, transport, workload), lambda m: m.per_second)

    title = "per second, median of the rounds (ratio to the first: median, range)"
    return _grid(title, setups, cell, results)


def cpu_table(results: Sequence[Measurement], setups: Sequence[Setup]) -> str:
    """CPU per item summed over every process (and as a ratio to one front-end's sum), then
    the main process's share: with front-ends, what every call still costs the parent."""
    by_key = _by_key(results)

    def cell(n: Setup, transport: str, workload: str) -> str:
        key, base = (n, transport, workload), (setups[0], transport, workload)
        main = statistics.median(m.main_cpu_us for m in by_key[key])
        return f"{_against_base(by_key, base, key, lambda m: m.total_cpu_us)} main {main:.0f}"

    title = "CPU us per item, all processes (ratio to the first), then the main process's"
    return _grid(title, setups, cell, results)


def projection_table(results: Sequence[Measurement], setups: Sequence[Setup]) -> str:
    """Per second on bigger hosts: cores over the summed CPU per item, capped by the busiest
    process that does not multiply with front-ends, whose part is named (a worker caps as it
    should; the parent must not); the medians of the rounds."""
    by_key = _by_key(results)

    def cell(n: Setup, transport: str, workload: str) -> str:
        mine = by_key[n, transport, workload]
        cores = "/".join(
            f"{statistics.median(m.projected[str(c)] for m in mine):.0f}" for c in PROJECTED_CORES
        )
        busiest = statistics.mode(m.busiest for m in mine)
        return f"{cores} ({busiest})"

    cores = " and ".join(str(c) for c in PROJECTED_CORES)
    title = f"projected per second on {cores} cores (the busiest process)"
    return _grid(title, setups, cell, results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--frontends", default="1,2,4", help="front-end counts, the first is 1")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the servers' order rotating")
    parser.add_argument(
        "--clients",
        type=int,
        default=max(2, len(os.sched_getaffinity(0)) // 2),
        help="client processes generating the load",
    )
    parser.add_argument(
        "--model",
        choices=("mlp", "mlp_numpy"),
        default="mlp",
        help="mlp (Paddle), or the same shapes as a Python-backend numpy model, for hosts "
        "without Paddle",
    )
    parser.add_argument(
        "--paths",
        default="batcher,queues",
        help="how calls reach the workers, each a server per front-end count: batcher (the "
        "server's), queues (--instance-queues: the worker batches); the first is the base",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"what each server is measured on, from {', '.join(WORKLOADS)}",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/scale.json"))
    args = parser.parse_args()
    counts = [int(n) for n in args.frontends.split(",")]
    paths = args.paths.split(",")
    requested = set(args.workloads.split(","))
    workloads = [w for w in WORKLOADS if w in requested]
    if (
        counts[0] != 1
        or min(args.clients, args.rounds) < 1
        or not set(paths) <= PATHS.keys()
        or not requested <= set(WORKLOADS)
    ):
        parser.error(
            "--frontends must start with 1 (the base of the ratios); --clients, --rounds >= 1; "
            f"--paths from {', '.join(PATHS)}; --workloads from {', '.join(WORKLOADS)}"
        )
    setups = [Setup(n, path) for path in paths for n in counts]
    results: list[Measurement] = []
    spawn = multiprocessing.get_context("spawn")  # grpc does not survive a fork
    with (
        tempfile.TemporaryDirectory() as tmp,
        ProcessPoolExecutor(args.clients, mp_context=spawn) as pool,
    ):
        repository = Path(tmp) / "models"
        if args.model == "mlp":
            model_repository(repository, ["mlp"])
        else:
            shutil.copytree(BENCH_MODELS / args.model, repository / args.model)
        certs = Path(tmp) / "certs"
        load = Load(args.clients, args.model, certs / "ca.pem", args.duration)
        print(
            f"{args.model}, {args.clients} client processes, {args.duration:g} s per measurement, "
            f"{args.rounds} rounds, {len(os.sched_getaffinity(0))} usable cores",
            flush=True,
        )
        for round_ in range(args.rounds):
            turn = round_ % len(setups)
            for setup in setups[turn:] + setups[:turn]:
                server = ServerProcess(
                    repository,
                    Path(tmp) / f"server-{round_}-{setup.frontends}-{setup.path}.log",
                    ["--certs-dir", str(certs), "--frontends", str(setup.frontends)]
                    + PATHS[setup.path],
                )
                try:
                    server.wait_ready()
                    for workload in workloads:
                        for transport in TRANSPORTS:
                            results.append(
                                measure(pool, load, round_, setup, transport, workload, server)
                            )
                finally:
                    server.stop()
    print()
    print(table(results, setups))
    print()
    print(cpu_table(results, setups))
    print()
    print(projection_table(results, setups))
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
