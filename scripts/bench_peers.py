"""`make bench-peers`: paddlequic against the servers a team would otherwise run, in
alternating rounds of one run, ModelInfer over gRPC on HTTP/2:

- `paddlequic`: this server, as tests/servers.py starts it (`--no-h3`), with its dynamic
  batching and worker processes;
- `paddlequic-batcher`: the same with `--no-instance-queues` (the server forms the batches,
  not the workers from their own queues, the default);
- `grpcio`: a plain grpc.aio KServe v2 server that runs the same Paddle predictor (the one our
  CPU workers make, same config) in its own process, one call at a time, no batching
  (scripts/peers/grpc_peer.py);
- `mlserver`, `mlserver-batching`: MLServer (its own venv, `.venv-mlserver`) with a custom
  runtime running the same predictor (scripts/peers/mlserver_runtime.py), without and with
  adaptive batching;
- `canned`: a grpc.aio server that answers every ModelInfer with a response built once,
  running nothing: the transport's ceiling.

Workloads: `mlp` at concurrency 32 and `mlp_wide` at concurrency 64, one random row per call.
The load comes from client processes that share the machine's cores with every server, so the
servers are measured in turn (the order rotates each round) and each round's ratios are taken
within it: the table gives their median and range. CPU per call is read from /proc/PID/stat
(utime + stime) for each server's whole process tree, before and after each measurement; for
paddlequic also per part (its server process, its workers), and against a bare ServerLive on
the same server at the same concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import numpy as np

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from scripts.bench_common import begin_rounds, median_range, round_options, tree_cpu, write_json
from tests.servers import (
    EXAMPLE_MODELS,
    REPO_ROOT,
    START_TIMEOUT_S,
    ServerProcess,
    free_port,
    model_repository,
)

OURS = "paddlequic"
OURS_BATCHER = "paddlequic-batcher"
OURSELVES = {OURS: [], OURS_BATCHER: ["--no-instance-queues"]}  # each with its own flags
CANNED = "canned"
PEERS = ("grpcio", "mlserver", "mlserver-batching")
SERVERS = (*OURSELVES, *PEERS, CANNED)
LIVE = "ServerLive"
MLSERVER_VENV = REPO_ROOT / ".venv-mlserver"
# MLServer's adaptive batching: at most a model's max_batch_size rows (its config.pbtxt),
# waiting at most this long for them: of 2, 10 and 50 ms, with 0 and 1 parallel workers, 10 ms
# with MLServer's default of 1 worker answered the most calls on both workloads here (docs/
# benchmarks.md, "make bench-peers").
MLSERVER_BATCH_TIME_S = 0.01
MLSERVER_WORKERS = 1
# Each client process: its share of the calls in flight, spread over this many connections.
CONNECTIONS_PER_CLIENT = 2
REQUESTS_PER_CLIENT = 64  # distinct random rows each client cycles through
WARM_UP_S = 1.0


@dataclass(frozen=True)
class Workload:
    model: str
    concurrency: int
    input: str
    width: int  # values per row


WORKLOADS = {
    w.model: w for w in (Workload("mlp", 32, "input", 256), Workload("mlp_wide", 64, "input", 2048))
}


@dataclass
class Row:
    round: int
    model: str
    concurrency: int
    server: str
    rpc: str  # ModelInfer; ServerLive (paddlequic's only)
    calls: int
    seconds: float
    per_second: float
    cpu_us: float  # per call, summed over the server's whole process tree
    main_cpu_us: float  # per call, its first process (paddlequic: the server process)
    frontends_cpu_us: float  # per call, paddlequic's front-end processes (--frontends N > 1)
    workers_cpu_us: float  # per call, every other process (paddlequic: workers, subreapers)
    processes: int


async def _calls(
    address: str, rpc: str, workload: Workload, concurrency: int, window: tuple[float, float]
) -> int:
    start, end = window
    rng = np.random.default_rng(os.getpid())
    requests = [
        build_request(
            workload.model, {workload.input: rng.standard_normal((1, workload.width), np.float32)}
        )
        for _ in range(REQUESTS_PER_CLIENT)
    ]
    live = pb.ServerLiveRequest()
    # grpc shares connections between a process's channels unless told not to.
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.aio.insecure_channel(address, options=options) for _ in range(CONNECTIONS_PER_CLIENT)
    ]
    stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]
    counted = 0

    async def caller(index: int) -> None:
        nonlocal counted
        stub = stubs[index % len(stubs)]
        while time.monotonic() < end:
            if rpc == LIVE:
                await stub.ServerLive(live, timeout=60)
            else:
                await stub.ModelInfer(requests[index % len(requests)], timeout=60)
            index += len(stubs)
            counted += start <= time.monotonic() <= end

    try:
        await asyncio.gather(*(caller(i) for i in range(concurrency)))
    finally:
        for channel in channels:
            await channel.close(None)
    return counted


def spawned() -> int:
    """Nothing: submitted once per client process before the first measurement, so each has
    started and imported what it needs before any window opens."""
    time.sleep(0.5)
    return os.getpid()


def client(
    address: str, rpc: str, model: str, concurrency: int, window: tuple[float, float]
) -> int:
    """One client process's share of a measurement: the calls that completed within `window`
    (time.monotonic, the same clock in every process); it calls from the moment it starts, so
    the time before the window warms up connections and servers."""
    return asyncio.run(_calls(address, rpc, WORKLOADS[model], concurrency, window))


class Server(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def models(self) -> frozenset[str]: ...

    @property
    def address(self) -> str: ...

    def root_pid(self) -> int: ...


@dataclass(frozen=True)
class Ours:
    """paddlequic behind the Server protocol."""

    process: ServerProcess
    models: frozenset[str]
    name: str = OURS

    @property
    def address(self) -> str:
        return self.process.address

    def root_pid(self) -> int:
        return self.process.process.pid


class Peer:
    """A peer server process serving `models`, ready once ServerReady answers true and each
    model answered a ModelInfer."""

    def __init__(
        self,
        name: str,
        models: frozenset[str],
        command: Sequence[str],
        log: Path,
        port: int,
        cwd: Path,
        http_port: int = 0,
    ) -> None:
        """`port`: its gRPC port; `http_port`: its REST port, where it has one."""
        self.name = name
        self.models = models
        self.address = f"127.0.0.1:{port}"
        self.http_address = f"127.0.0.1:{http_port}"
        self.log = log
        environment = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "OMP_NUM_THREADS": "1",
            "GLOG_minloglevel": "2",
        }
        with log.open("wb") as output:
            self.process = subprocess.Popen(
                command, cwd=cwd, env=environment, stdout=output, stderr=subprocess.STDOUT
            )

    def root_pid(self) -> int:
        return self.process.pid

    def wait_ready(self, models: Sequence[Workload]) -> None:
        """Raises RuntimeError with the reason (a failed ModelInfer at once, not at the
        deadline)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            while not self._ready(stub):
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited ({self.process.returncode}): {self.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.name} not ready after {START_TIMEOUT_S:.0f} s: {self.log_tail()}"
                    )
                time.sleep(0.2)
            for w in (w for w in models if w.model in self.models):
                row = {w.input: np.zeros((1, w.width), np.float32)}
                try:
                    stub.ModelInfer(build_request(w.model, row), timeout=60)
                except grpc.RpcError as exc:
                    raise RuntimeError(
                        f"{self.name} failed a {w.model} ModelInfer: {exc}\n{self.log_tail()}"
                    ) from None

    @staticmethod
    def _ready(stub: pb_grpc.GRPCInferenceServiceStub) -> bool:
        try:
            return bool(stub.ServerReady(pb.ServerReadyRequest(), timeout=1).ready)
        except grpc.RpcError:
            return False  # not listening yet

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass(frozen=True)
class Setup:
    """What every server of a run is started with."""

    repository: Path  # the workloads' models
    root: Path  # logs, MLServer's settings
    workloads: Sequence[Workload]
    mlserver_workers: int  # MLServer's parallel_workers
    mlserver_batch_time: float  # seconds
    frontends: int  # paddlequic's --frontends


def grpc_peer(kind: str, name: str, setup: Setup) -> Peer:
    port = free_port()
    root = setup.root
    models = sorted(str(p) for p in setup.repository.iterdir())
    command = [
        sys.executable,
        "-m",
        "scripts.peers.grpc_peer",
        "--port",
        str(port),
        "--kind",
        kind,
        *models,
    ]
    served = frozenset(w.model for w in setup.workloads)
    return Peer(name, served, command, root / f"{name}.log", port, REPO_ROOT)


def mlserver_missing() -> str | None:
    """Why MLServer cannot be measured, or None."""
    if not (MLSERVER_VENV / "bin" / "mlserver").exists():
        return f"{MLSERVER_VENV.name} is missing (`make bench-peers` creates it)"
    return None


def mlserver(name: str, batching: bool, directory: Path, setup: Setup) -> Peer:
    """MLServer serving the model in `directory` with the custom runtime. One model per MLServer,
    as paddlequic gives each model a worker process of its own: two Paddle predictors in one
    process that batches cost several times the CPU per call here (mlp_wide with mlp beside it
    at concurrency 64: 11.6 against 3.1 ms). Settings as for production (no debug logging),
    `setup.mlserver_workers` parallel workers (0: inference in the server's own process);
    everything else at MLServer's defaults (metrics on)."""
    from google.protobuf import text_format

    from protos.inference import model_config_pb2 as mc

    root = setup.root
    config = text_format.Parse((directory / "config.pbtxt").read_text(), mc.ModelConfig())
    home = root / f"{name}-{config.name}"
    port, http_port = free_port(), free_port()
    settings = {
        "debug": False,
        "host": "127.0.0.1",
        "grpc_port": port,
        "http_port": http_port,
        "metrics_port": free_port(),
        "model_repository_root": str(home),
        "metrics_dir": str(home / ".metrics"),
        "parallel_workers": setup.mlserver_workers,
    }
    home.mkdir()
    (home / "settings.json").write_text(json.dumps(settings, indent=2))
    model: dict[str, Any] = {
        "name": config.name,
        "implementation": "scripts.peers.mlserver_runtime.PaddleRuntime",
        "parameters": {"uri": str(directory)},
    }
    if batching:
        batch_time = setup.mlserver_batch_time
        model |= {"max_batch_size": config.max_batch_size, "max_batch_time": batch_time}
    (home / config.name).mkdir()
    (home / config.name / "model-settings.json").write_text(json.dumps(model, indent=2))
    command = [str(MLSERVER_VENV / "bin" / "mlserver"), "start", str(home)]
    log = root / f"{home.name}.log"
    return Peer(name, frozenset([config.name]), command, log, port, home, http_port)


@dataclass(frozen=True)
class Load:
    pool: ProcessPoolExecutor
    clients: int
    duration: float


def measure(load: Load, server: Server, workload: Workload, rpc: str, index: int) -> Row:
    start = time.monotonic() + WARM_UP_S
    window = (start, start + load.duration)
    shares = [
        workload.concurrency // load.clients + (i < workload.concurrency % load.clients)
        for i in range(load.clients)
    ]
    jobs = [
        load.pool.submit(client, server.address, rpc, workload.model, n, window)
        for n in shares
        if n
    ]
    time.sleep(max(0.0, start - time.monotonic()))
    before = tree_cpu(server.root_pid())
    time.sleep(max(0.0, window[1] - time.monotonic()))
    after = tree_cpu(server.root_pid())
    calls = sum(job.result() for job in jobs)
    spent = dict.fromkeys(("main", "frontends", "workers"), 0.0)
    for pid, (part, cpu) in after.items():
        spent[part] += cpu - before.get(pid, (part, 0.0))[1]
    per_call = 1e6 / max(calls, 1)
    row = Row(
        index,
        workload.model,
        workload.concurrency,
        server.name,
        rpc,
        calls,
        load.duration,
        round(calls / load.duration, 1),
        round(sum(spent.values()) * per_call, 1),
        round(spent["main"] * per_call, 1),
        round(spent["frontends"] * per_call, 1),
        round(spent["workers"] * per_call, 1),
        len(after),
    )
    print(
        f"  round {index} {workload.model:<8} c={workload.concurrency:<3} {server.name:<17} "
        f"{rpc:<10} {row.per_second:>8.1f}/s  CPU per call {row.cpu_us:>6.0f} us "
        f"({row.main_cpu_us:.0f} first process, {row.frontends_cpu_us:.0f} front-ends, "
        f"{row.workers_cpu_us:.0f} the others)",
        flush=True,
    )
    return row


def rotated(items: Sequence[Any], by: int) -> list[Any]:
    """The servers' order in round `by`: each takes every place in turn."""
    by %= len(items)
    return [*items[by:], *items[:by]]


def _groups(rows: Sequence[Row], model: str) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = {}
    for row in rows:
        if row.model == model:
            key = f"{row.server} {LIVE}" if row.rpc == LIVE else row.server
            groups.setdefault(key, []).append(row)
    return groups


def _ratios(
    numerators: Sequence[Row], denominators: Sequence[Row], field: str = "per_second"
) -> str:
    ratios = [
        getattr(a, field) / getattr(b, field)
        for a, b in zip(numerators, denominators, strict=True)
        if getattr(b, field)
    ]
    return median_range(ratios) if ratios else "n/a"


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def _compared(mine: str, groups: dict[str, list[Row]], peers: list[list[Row]]) -> list[str]:
    """One of our servers against the best peer of each round, the canned ceiling and its
    own bare ServerLive."""
    ours = groups.get(mine, [])
    if not ours:
        return []
    lines = []
    if peers:
        best = [max(by_round, key=lambda r: r.per_second) for by_round in zip(*peers, strict=True)]
        named = ", ".join(sorted({r.server for r in best}))
        lines.append(f"{mine} / best peer ({named}), calls/s: {_ratios(ours, best)}")
    if CANNED in groups:
        lines.append(f"{mine} / {CANNED} ceiling, calls/s: {_ratios(ours, groups[CANNED])}")
    live = groups.get(f"{mine} {LIVE}", [])
    if live:
        lines.append(
            f"{mine} ModelInfer / bare {LIVE}, CPU per call: all processes "
            f"{_ratios(ours, live, 'cpu_us')}; the server process alone "
            f"{_ratios(ours, live, 'main_cpu_us')}"
        )
    return lines


def summary(rows: Sequence[Row], rounds: int) -> str:
    lines = [
        "\nCPU per call: a server's whole process tree; its first process (paddlequic's server "
        "process, a peer's main one), paddlequic's front-ends (--frontends N > 1) and the others "
        "(paddlequic's workers and their subreapers, MLServer's parallel workers)"
    ]
    for workload in WORKLOADS.values():
        groups = _groups(rows, workload.model)
        if not groups:
            continue
        lines += [
            f"\n{workload.model}, concurrency {workload.concurrency}: median [lowest-highest] "
            f"of {rounds} rounds",
            f"{'server':<22} {'calls/s':>18} {'CPU us/call, all processes':>27} "
            f"{'first process':>17} {'front-ends':>11} {'the others':>17}",
        ]
        for name, group in groups.items():
            lines.append(
                f"{name:<22} {_spread([r.per_second for r in group]):>18} "
                f"{_spread([r.cpu_us for r in group]):>27} "
                f"{_spread([r.main_cpu_us for r in group]):>17} "
                f"{_spread([r.frontends_cpu_us for r in group]):>11} "
                f"{_spread([r.workers_cpu_us for r in group]):>17}"
            )
        peers = [groups[p] for p in PEERS if p in groups]
        for mine in OURSELVES:
            lines += _compared(mine, groups, peers)
    return "\n".join(lines)


@contextlib.contextmanager
def started(names: Sequence[str], setup: Setup) -> Iterator[list[Server]]:
    """Every server asked for, ready; MLServer left out (with the reason printed) if it cannot
    run here."""
    ours: dict[str, ServerProcess] = {}
    peers: list[Peer] = []
    servers: list[Server] = []
    served = frozenset(w.model for w in setup.workloads)
    try:
        for name in names:
            if name in OURSELVES:
                flags = ["--no-h3", "--frontends", str(setup.frontends), *OURSELVES[name]]
                log = setup.root / f"{name}.log"
                ours[name] = ServerProcess(setup.repository, log, flags)
            elif name in ("grpcio", CANNED):
                peers.append(grpc_peer("predictor" if name == "grpcio" else "canned", name, setup))
            elif (reason := mlserver_missing()) is not None:
                print(f"{name} left out: {reason}", flush=True)
            else:
                batching = name == "mlserver-batching"
                for directory in sorted(setup.repository.iterdir()):
                    peers.append(mlserver(name, batching, directory, setup))
        for name, process in ours.items():
            process.wait_ready()
            servers.append(Ours(process, served, name))
        for peer in peers:
            try:
                peer.wait_ready(setup.workloads)
            except RuntimeError as exc:
                if not peer.name.startswith("mlserver"):
                    raise
                print(f"{peer.name} left out: {exc}", flush=True)
                peer.stop()
                continue
            servers.append(peer)
        yield servers
    finally:
        for peer in peers:
            peer.stop()
        for process in ours.values():
            process.stop()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    round_options(parser, SERVERS)
    parser.add_argument(
        "--models", default=",".join(WORKLOADS), help=f"comma-separated, of {','.join(WORKLOADS)}"
    )
    parser.add_argument(
        "--mlserver-workers",
        type=int,
        default=MLSERVER_WORKERS,
        help="MLServer's parallel_workers (0: inference in its server process)",
    )
    parser.add_argument(
        "--mlserver-batch-time",
        type=float,
        default=MLSERVER_BATCH_TIME_S,
        help="MLServer's max_batch_time (seconds) with adaptive batching",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/bench_peers.json"))
    args = parser.parse_args()
    names = [n for n in SERVERS if n in args.servers.split(",")]
    workloads = [WORKLOADS[m] for m in args.models.split(",") if m in WORKLOADS]
    if not names or not workloads or args.rounds < 1 or args.clients < 1:
        parser.error(
            f"--servers among {SERVERS}, --models among {tuple(WORKLOADS)}; --rounds and "
            "--clients >= 1"
        )
    for workload in workloads:
        if not (EXAMPLE_MODELS / workload.model / "1").is_dir():
            raise SystemExit(f"model {workload.model} is not exported; run `make models-bench`")
    begin_rounds(args.clients, args.rounds, args.duration, "server and workload")
    rows: list[Row] = []
    spawn = multiprocessing.get_context("spawn")  # grpc does not survive a fork
    with (
        tempfile.TemporaryDirectory() as tmp,
        ProcessPoolExecutor(args.clients, mp_context=spawn) as pool,
    ):
        root = Path(tmp)
        repository = model_repository(root / "models", [w.model for w in workloads])
        setup = Setup(
            repository,
            root,
            workloads,
            args.mlserver_workers,
            args.mlserver_batch_time,
            args.frontends,
        )
        with started(names, setup) as servers:
            if not servers:
                raise SystemExit("no server could be started")
            load = Load(pool, args.clients, args.duration)
            for job in [pool.submit(spawned) for _ in range(args.clients)]:
                job.result()
            for index in range(args.rounds):
                for workload in workloads:
                    serving = [s for s in servers if workload.model in s.models]
                    plan = [(s, "ModelInfer") for s in serving]
                    plan += [(s, LIVE) for s in serving if s.name in OURSELVES]
                    for server, rpc in rotated(plan, index):
                        rows.append(measure(load, server, workload, rpc, index))
    print(summary(rows, args.rounds))
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
