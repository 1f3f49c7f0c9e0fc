"""`make bench-http`: this server's REST API against its own gRPC and against the REST servers
a team would otherwise run, in alternating rounds of one run.

- `mlp` at concurrency 32, one random row per call: paddlequic's `POST /v2/models/mlp/infer`
  with JSON tensors (`rest-json`) and with Triton's binary tensor data extension
  (`rest-binary`: the row's bytes after the JSON header, the output asked for as binary), its
  own gRPC ModelInfer (`grpc`, HTTP/2), MLServer's REST (`.venv-mlserver`, the Paddle runtime
  of scripts/peers/mlserver_runtime.py, without and with adaptive batching) and a FastAPI app
  on uvicorn running the same predictor in its own process (scripts/peers/fastapi_peer.py);
  the peers get the same JSON bodies.
- `generate` at concurrency 8, the same greedy generation of GENERATION_TOKENS tokens each
  call: `generate_stream` (server-sent events, `sse`) against gRPC ModelStreamInfer
  (`grpc-stream`), on the same server.

paddlequic is one server (`--no-h3`, `--http-port`, `--frontends N`) serving both protocols.
The load comes from client processes (aiohttp with HTTP/1.1 keep-alive, a connection per call
in flight; grpc.aio as `make bench-peers`) that share the machine's cores with every server,
so the runs are measured in turn (the order rotates each round) and each round's ratios are
taken within it: the table gives their median and range. CPU is read from /proc/PID/stat for
each server's whole process tree before and after each measurement: per call for `mlp`, per
generated token (paddlequic's own token counter over the same window) for `generate`.

Goals (issue 44): binary REST at most 1.3x gRPC's server CPU per call; REST requests/s at
least 1.5x the best peer's on `mlp` at concurrency 32; server CPU per streamed token over SSE
at most 1.2x gRPC streaming's. Each is reported as reached or not, on its median ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np

from protos.inference import grpc_service_pb2_grpc as pb_grpc
from scripts import bench_peers
from scripts.bench_common import (
    begin_rounds,
    cpu_spent,
    median_range,
    round_options,
    tree_cpu,
    write_json,
)
from scripts.bench_generate import one_request
from scripts.bench_peers import Peer, Setup, mlserver, mlserver_missing, rotated, spawned
from tests.servers import (
    EXAMPLE_MODELS,
    REPO_ROOT,
    START_TIMEOUT_S,
    ServerProcess,
    free_port,
    model_repository,
)

OURS = "paddlequic"
FASTAPI = "fastapi"
MLSERVERS = ("mlserver", "mlserver-batching")
PEERS = (*MLSERVERS, FASTAPI)
SERVERS = (OURS, *PEERS)
GRPC, JSON, BINARY = "grpc", "rest-json", "rest-binary"
GRPC_STREAM, SSE = "grpc-stream", "sse"
INFER = bench_peers.WORKLOADS["mlp"]  # mlp, concurrency 32, [1, 256] FP32
INFER_PATH = f"/v2/models/{INFER.model}/infer"
# aiohttp asks for gzip by default, which paddlequic honours (Triton's behaviour) and the
# peers ignore: every request asks for no compression, so all compare the same answers.
IDENTITY = {"accept-encoding": "identity"}
GENERATION_MODEL = "generate"
GENERATION_CONCURRENCY = 8
GENERATION_TOKENS = 32  # max_tokens of every generation (greedy: the same text each time)
TOKENS_METRIC = "paddlequic_generated_tokens_total"
REQUESTS_PER_CLIENT = bench_peers.REQUESTS_PER_CLIENT  # distinct random rows per client
WARM_UP_S = bench_peers.WARM_UP_S
CALL_TIMEOUT_S = 120.0
# Goals of issue 44, on the median ratio within rounds.
GOAL_BINARY_CPU = 1.3  # rest-binary / grpc, CPU per call, at most
GOAL_REST_RATE = 1.5  # REST / best peer, calls per second, at least
GOAL_SSE_CPU = 1.2  # sse / grpc-stream, CPU per token, at most


@dataclass
class Row:
    round: int
    model: str
    concurrency: int
    server: str
    protocol: str  # grpc, rest-json, rest-binary (mlp); grpc-stream, sse (generate)
    calls: int  # completed within the window
    tokens: int  # generated within the window (generate; 0 for mlp)
    seconds: float
    per_second: float  # calls
    cpu_us: float  # per call, summed over the server's whole process tree
    cpu_us_per_token: float  # generate; 0 for mlp
    main_cpu_us: float  # per call, its first process (paddlequic: the server process)
    frontends_cpu_us: float  # per call, paddlequic's front-end processes (--frontends N > 1)
    workers_cpu_us: float  # per call, every other process (paddlequic: workers, subreapers)
    processes: int


@dataclass(frozen=True)
class Endpoint:
    """A server to measure: where its protocols answer and its process tree's root."""

    name: str
    root_pid: int
    grpc_address: str  # paddlequic only
    http_address: str
    tokens: Callable[[], float] | None = None  # paddlequic's generated-token counter


def infer_bodies(protocol: str, seed: int) -> list[tuple[bytes, dict[str, str]]]:
    """REQUESTS_PER_CLIENT request bodies of one random row each, with their headers."""
    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(REQUESTS_PER_CLIENT):
        row = rng.standard_normal((1, INFER.width), np.float32)
        tensor: dict[str, Any] = {
            "name": INFER.input,
            "datatype": "FP32",
            "shape": [1, INFER.width],
        }
        if protocol == BINARY:
            tensor["parameters"] = {"binary_data_size": row.nbytes}
            header = json.dumps(
                {"inputs": [tensor], "parameters": {"binary_data_output": True}}
            ).encode()
            headers = {
                **IDENTITY,
                "content-type": "application/octet-stream",
                "inference-header-content-length": str(len(header)),
            }
            bodies.append((header + row.tobytes(), headers))
        else:
            tensor["data"] = row.ravel().tolist()
            body = json.dumps({"inputs": [tensor]}).encode()
            bodies.append((body, {**IDENTITY, "content-type": "application/json"}))
    return bodies


def generation_body() -> bytes:
    return json.dumps({"text": "Once upon a time", "max_tokens": GENERATION_TOKENS}).encode()


async def _rest_calls(
    protocol: str, address: str, concurrency: int, window: tuple[float, float]
) -> int:
    start, end = window
    if protocol == SSE:
        path = f"/v2/models/{GENERATION_MODEL}/generate_stream"
        bodies = [(generation_body(), {**IDENTITY, "content-type": "application/json"})]
    else:
        path, bodies = INFER_PATH, infer_bodies(protocol, os.getpid())
    counted = 0
    timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(
        f"http://{address}", connector=connector, timeout=timeout
    ) as session:

        async def caller(index: int) -> None:
            nonlocal counted
            while time.monotonic() < end:
                body, headers = bodies[index % len(bodies)]
                async with session.post(path, data=body, headers=headers) as response:
                    payload = await response.read()  # an event stream: to its end
                    if response.status != 200:
                        raise RuntimeError(f"{path}: {response.status} {payload[:300]!r}")
                index += 1
                counted += start <= time.monotonic() <= end

        await asyncio.gather(*(caller(i) for i in range(concurrency)))
    return counted


async def _grpc_streams(address: str, concurrency: int, window: tuple[float, float]) -> int:
    start, end = window
    counted = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def caller() -> None:
            nonlocal counted
            while time.monotonic() < end:
                await one_request(stub, GENERATION_MODEL, GENERATION_TOKENS)
                counted += start <= time.monotonic() <= end

        await asyncio.gather(*(caller() for _ in range(concurrency)))
    return counted


def client(
    protocol: str,
    grpc_address: str,
    http_address: str,
    concurrency: int,
    window: tuple[float, float],
) -> int:
    """One client process's share of a measurement: the calls that completed within `window`
    (time.monotonic); it calls from the moment it starts, which warms connections up."""
    if protocol == GRPC:
        return bench_peers.client(grpc_address, "ModelInfer", INFER.model, concurrency, window)
    if protocol == GRPC_STREAM:
        return asyncio.run(_grpc_streams(grpc_address, concurrency, window))
    return asyncio.run(_rest_calls(protocol, http_address, concurrency, window))


@dataclass(frozen=True)
class Load:
    pool: ProcessPoolExecutor
    clients: int
    duration: float


def measure(load: Load, endpoint: Endpoint, protocol: str, index: int) -> Row:
    streaming = protocol in (GRPC_STREAM, SSE)
    model = GENERATION_MODEL if streaming else INFER.model
    concurrency = GENERATION_CONCURRENCY if streaming else INFER.concurrency
    start = time.monotonic() + WARM_UP_S
    window = (start, start + load.duration)
    shares = [
        concurrency // load.clients + (i < concurrency % load.clients) for i in range(load.clients)
    ]
    addresses = (endpoint.grpc_address, endpoint.http_address)
    jobs = [load.pool.submit(client, protocol, *addresses, n, window) for n in shares if n]
    time.sleep(max(0.0, start - time.monotonic()))
    tokens_before = endpoint.tokens() if streaming and endpoint.tokens else 0.0
    before = tree_cpu(endpoint.root_pid)
    time.sleep(max(0.0, window[1] - time.monotonic()))
    after = tree_cpu(endpoint.root_pid)
    tokens = int(endpoint.tokens() - tokens_before) if streaming and endpoint.tokens else 0
    calls = sum(job.result() for job in jobs)
    spent = cpu_spent(before, after)
    per_call = 1e6 / max(calls, 1)
    row = Row(
        index,
        model,
        concurrency,
        endpoint.name,
        protocol,
        calls,
        tokens,
        load.duration,
        round(calls / load.duration, 1),
        round(sum(spent.values()) * per_call, 1),
        round(sum(spent.values()) * 1e6 / tokens, 1) if tokens else 0.0,
        round(spent["main"] * per_call, 1),
        round(spent["frontends"] * per_call, 1),
        round(spent["workers"] * per_call, 1),
        len(after),
    )
    per_token = f", per token {row.cpu_us_per_token:.0f} us" if streaming else ""
    print(
        f"  round {index} {model:<8} c={concurrency:<3} {endpoint.name:<17} {protocol:<11} "
        f"{row.per_second:>8.1f}/s  CPU per call {row.cpu_us:>6.0f} us{per_token}",
        flush=True,
    )
    return row


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def _ratios(numerators: Sequence[Row], denominators: Sequence[Row], field: str) -> list[float]:
    return [
        getattr(a, field) / getattr(b, field)
        for a, b in zip(numerators, denominators, strict=True)
        if getattr(b, field)
    ]


def _goal(name: str, ratios: Sequence[float], bound: float, at_most: bool) -> str:
    if not ratios:
        return f"{name}: n/a"
    median = statistics.median(ratios)
    reached = median <= bound if at_most else median >= bound
    sign = "<=" if at_most else ">="
    verdict = "reached" if reached else "NOT reached"
    return f"{name}: {median_range(ratios)}, goal {sign} {bound:g}x: {verdict}"


def summary(rows: Sequence[Row], rounds: int) -> str:
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.server, row.protocol), []).append(row)
    lines = [
        f"\nmedian [lowest-highest] of {rounds} rounds; CPU: the server's whole process tree",
        f"{'model':<9} {'server':<18} {'protocol':<12} {'calls/s':>16} {'CPU us/call':>16} "
        f"{'CPU us/token':>16}",
    ]
    for (server, protocol), group in groups.items():
        per_token = _spread([r.cpu_us_per_token for r in group]) if group[0].tokens else "-"
        lines.append(
            f"{group[0].model:<9} {server:<18} {protocol:<12} "
            f"{_spread([r.per_second for r in group]):>16} "
            f"{_spread([r.cpu_us for r in group]):>16} {per_token:>16}"
        )
    lines.append("")
    grpc_rows = groups.get((OURS, GRPC), [])
    for protocol in (BINARY, JSON):
        ours = groups.get((OURS, protocol), [])
        if ours and grpc_rows:
            ratios = _ratios(ours, grpc_rows, "cpu_us")
            if protocol == BINARY:
                lines.append(
                    _goal(
                        f"{OURS} {protocol} / {GRPC}, CPU per call", ratios, GOAL_BINARY_CPU, True
                    )
                )
            else:
                lines.append(f"{OURS} {protocol} / {GRPC}, CPU per call: {median_range(ratios)}")
    peers = [groups[(p, JSON)] for p in PEERS if (p, JSON) in groups]
    if peers:
        best = [max(by_round, key=lambda r: r.per_second) for by_round in zip(*peers, strict=True)]
        named = ", ".join(sorted({r.server for r in best}))
        for protocol in (JSON, BINARY):
            ours = groups.get((OURS, protocol), [])
            if ours:
                name = f"{OURS} {protocol} / best peer ({named}), calls/s"
                lines.append(_goal(name, _ratios(ours, best, "per_second"), GOAL_REST_RATE, False))
    sse, streams = groups.get((OURS, SSE), []), groups.get((OURS, GRPC_STREAM), [])
    if sse and streams:
        ratios = _ratios(sse, streams, "cpu_us_per_token")
        lines.append(
            _goal(f"{OURS} {SSE} / {GRPC_STREAM}, CPU per token", ratios, GOAL_SSE_CPU, True)
        )
    return "\n".join(lines)


def fastapi_peer(python: str, directory: Path, root: Path) -> Peer:
    port = free_port()
    command = [python, "-m", "scripts.peers.fastapi_peer", "--port", str(port), str(directory)]
    models = frozenset([INFER.model])
    return Peer(FASTAPI, models, command, root / "fastapi.log", port, REPO_ROOT, http_port=port)


def wait_rest_ready(peer: Peer) -> None:
    """Until the peer's REST port answers /v2/health/ready with 200 (MLServer answers 400
    while its model loads) and then one infer; RuntimeError with the reason (its exit, a
    failed infer, the deadline) otherwise."""
    deadline = time.monotonic() + START_TIMEOUT_S
    url = f"http://{peer.http_address}"
    while True:
        if peer.process.poll() is not None:
            raise RuntimeError(f"exited ({peer.process.returncode}): {peer.log_tail()}")
        # OSError: not listening yet, or not ready (an HTTPError)
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2),
        ):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {START_TIMEOUT_S:.0f} s: {peer.log_tail()}")
        time.sleep(0.2)
    body, headers = infer_bodies(JSON, 0)[0]
    try:
        with urllib.request.urlopen(urllib.request.Request(url + INFER_PATH, body, headers)):
            return
    except urllib.error.HTTPError as exc:
        raise RuntimeError(
            f"answered {exc.code}: {exc.read()[:300]!r}\n{peer.log_tail()}"
        ) from None


def _tokens(server: ServerProcess) -> Callable[[], float]:
    def generated() -> float:
        return sum(
            s.value
            for s in server.metrics()
            if s.name == TOKENS_METRIC and s.labels.get("model") == GENERATION_MODEL
        )

    return generated


@contextlib.contextmanager
def started(names: Sequence[str], setup: Setup, fastapi_python: str) -> Iterator[list[Endpoint]]:
    """Every server asked for, ready; a peer that cannot run here is left out with the reason
    printed."""
    ours: ServerProcess | None = None
    peers: list[Peer] = []
    endpoints: list[Endpoint] = []
    directory = setup.repository / INFER.model
    try:
        if OURS in names:
            http_port = free_port()
            flags = ["--no-h3", "--frontends", str(setup.frontends), "--http-port", str(http_port)]
            ours = ServerProcess(setup.repository, setup.root / "paddlequic.log", flags)
        for name in MLSERVERS:
            if name not in names:
                continue
            if (reason := mlserver_missing()) is not None:
                print(f"{name} left out: {reason}", flush=True)
                continue
            peers.append(mlserver(name, name == "mlserver-batching", directory, setup))
        if FASTAPI in names:
            peers.append(fastapi_peer(fastapi_python, directory, setup.root))
        if ours is not None:
            ours.wait_ready()
            endpoints.append(
                Endpoint(
                    OURS, ours.process.pid, ours.address, f"127.0.0.1:{http_port}", _tokens(ours)
                )
            )
        for peer in peers:
            try:
                wait_rest_ready(peer)
            except RuntimeError as exc:
                print(f"{peer.name} left out: {exc}", flush=True)
                peer.stop()
                continue
            endpoints.append(Endpoint(peer.name, peer.root_pid(), "", peer.http_address))
        yield endpoints
    finally:
        for peer in peers:
            peer.stop()
        if ours is not None:
            ours.stop()


def plan(
    endpoints: Sequence[Endpoint],
) -> tuple[list[tuple[Endpoint, str]], list[tuple[Endpoint, str]]]:
    """The measurements of a round: mlp's, then generate's (paddlequic only)."""
    infer: list[tuple[Endpoint, str]] = []
    stream: list[tuple[Endpoint, str]] = []
    for endpoint in endpoints:
        if endpoint.name == OURS:
            infer += [(endpoint, GRPC), (endpoint, JSON), (endpoint, BINARY)]
            stream += [(endpoint, GRPC_STREAM), (endpoint, SSE)]
        else:
            infer.append((endpoint, JSON))
    return infer, stream


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    round_options(parser, SERVERS)
    parser.add_argument(
        "--fastapi-python",
        default=sys.executable,
        help="the interpreter that runs the FastAPI peer (it needs fastapi and uvicorn, "
        "dev dependencies)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/bench_http.json"))
    args = parser.parse_args()
    names = [n for n in SERVERS if n in args.servers.split(",")]
    if not names or args.rounds < 1 or args.clients < 1:
        parser.error(f"--servers among {SERVERS}; --rounds and --clients >= 1")
    for model in (INFER.model, GENERATION_MODEL):
        if not (EXAMPLE_MODELS / model / "1").is_dir():
            raise SystemExit(f"model {model} is not exported; run `make models`")
    begin_rounds(args.clients, args.rounds, args.duration, "measurement")
    rows: list[Row] = []
    spawn = multiprocessing.get_context("spawn")  # grpc does not survive a fork
    with (
        tempfile.TemporaryDirectory() as tmp,
        ProcessPoolExecutor(args.clients, mp_context=spawn) as pool,
    ):
        root = Path(tmp)
        repository = model_repository(root / "models", [INFER.model, GENERATION_MODEL])
        setup = Setup(
            repository,
            root,
            [INFER],
            bench_peers.MLSERVER_WORKERS,
            bench_peers.MLSERVER_BATCH_TIME_S,
            args.frontends,
        )
        with started(names, setup, args.fastapi_python) as endpoints:
            if not endpoints:
                raise SystemExit("no server could be started")
            load = Load(pool, args.clients, args.duration)
            for job in [pool.submit(spawned) for _ in range(args.clients)]:
                job.result()
            infer, stream = plan(endpoints)
            for index in range(args.rounds):
                runs = rotated(infer, index) + (rotated(stream, index) if stream else [])
                for endpoint, protocol in runs:
                    rows.append(measure(load, endpoint, protocol, index))
    print(summary(rows, args.rounds))
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
