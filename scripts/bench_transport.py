"""`make bench-transport`: gRPC over HTTP/3 against gRPC over HTTP/2, same server, same run.

Measures ModelInfer requests/s at concurrency 1 and 64 and ModelStreamInfer messages/s (64 in
flight on one stream) on the small `mlp` model, with CPU time per call of the server's
front-end process (from /proc, so other processes' load does not count) and of this client
process; then the server CPU time per new connection (handshake, one ModelInfer, close): HTTP/3
full handshake, HTTP/3 resumed with 0-RTT, and plain HTTP/2 for reference.

Machines are noisy, so the transports alternate in rounds (h2 first in one round, h3 first in
the next) and the table shows each figure's median over the rounds with its spread (lowest and
highest), and the HTTP/3 / HTTP/2 ratio per round, then its median.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from clients.inference_client import build_request
from clients.quic_channel import QuicChannel
from clients.tickets import SessionTicketCache
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from scripts.bench_common import closed_loop, process_cpu_seconds, write_json
from tests.servers import ServerProcess, model_repository

Load = Callable[[float], Awaitable[int]]
TRANSPORTS = ("h2", "h3")
WORKLOADS = (("ModelInfer", 1), ("ModelInfer", 64), ("StreamInfer", 64))
CONNECTION_MODES = ("h3-full", "h3-0rtt", "h2")
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]
# Lets a closed connection's teardown (CONNECTION_CLOSE, draining, clean-up) happen before the
# server's CPU time is read, so it is counted with the connections measured.
SETTLE_S = 0.3


@dataclass
class Measurement:
    round: int
    transport: str
    workload: str
    concurrency: int
    count: int
    seconds: float
    per_second: float
    server_cpu_us_per_call: float
    client_cpu_us_per_call: float


@dataclass
class ConnectionCost:
    round: int
    mode: str  # h3-full, h3-0rtt, h2
    connections: int
    server_cpu_us_per_connection: float
    connect_modes: dict[str, int]  # QuicChannel.last_connect_mode counts (h3 only)


async def measure(
    round_: int,
    transport: str,
    workload: str,
    concurrency: int,
    duration: float,
    server_pid: int,
    run: Load,
) -> Measurement:
    await run(min(duration / 4, 1.0))  # warm-up: connections, predictor shapes
    server0, client0, t0 = process_cpu_seconds(server_pid), time.process_time(), time.perf_counter()
    count = await run(duration)
    seconds = time.perf_counter() - t0
    server_cpu = process_cpu_seconds(server_pid) - server0
    client_cpu = time.process_time() - client0
    result = Measurement(
        round_,
        transport,
        workload,
        concurrency,
        count,
        round(seconds, 3),
        round(count / seconds, 1),
        round(server_cpu / count * 1e6, 1),
        round(client_cpu / count * 1e6, 1),
    )
    print(
        f"  round {round_} {transport} {workload:<12} c={concurrency:<3} "
        f"{result.per_second:>8.1f}/s  server {result.server_cpu_us_per_call:>6.0f} us/call",
        flush=True,
    )
    return result


def unary_load(stub: Any, request: pb.ModelInferRequest, concurrency: int) -> Load:
    async def run(duration: float) -> int:
        return len(await closed_loop(stub, request, concurrency, duration))

    return run


def stream_load(stub: Any, request: pb.ModelInferRequest, window: int) -> Load:
    async def run(duration: float) -> int:
        end = time.perf_counter() + duration
        credit = asyncio.Semaphore(window)

        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            while time.perf_counter() < end:
                await credit.acquire()
                yield request

        received = 0
        async for response in stub.ModelStreamInfer(requests()):
            if response.error_message:
                raise RuntimeError(response.error_message)
            received += 1
            credit.release()
        return received

    return run


def open_channel(transport: str, server: ServerProcess, ca_file: Path) -> Any:
    if transport == "h2":
        return grpc.aio.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    return QuicChannel(f"localhost:{server.port}", ca_file=str(ca_file))


async def measure_calls(
    round_: int, transport: str, server: ServerProcess, ca_file: Path, duration: float
) -> list[Measurement]:
    request = build_request("mlp", {"input": np.ones((1, 256), np.float32)})
    channel = open_channel(transport, server, ca_file)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    pid = server.process.pid
    results = []
    try:
        for workload, concurrency in WORKLOADS:
            load = (
                unary_load(stub, request, concurrency)
                if workload == "ModelInfer"
                else stream_load(stub, request, concurrency)
            )
            results.append(
                await measure(round_, transport, workload, concurrency, duration, pid, load)
            )
    finally:
        await channel.close()
    return results


def connection_opener(mode: str, server: ServerProcess, ca_file: Path) -> Callable[[], Any]:
    """What opens a new channel (and so a new connection) for `mode`."""
    if mode == "h2":
        # grpc shares connections between a process's channels unless told not to.
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        return lambda: grpc.aio.insecure_channel(server.address, options=options)
    # h3-0rtt: one cache for all; each resumed connection leaves the ticket the next one uses.
    cache = SessionTicketCache() if mode == "h3-0rtt" else None
    target = f"localhost:{server.port}"
    return lambda: QuicChannel(target, ca_file=str(ca_file), ticket_cache=cache)


async def measure_connections(
    round_: int, mode: str, server: ServerProcess, ca_file: Path, connections: int
) -> ConnectionCost:
    request = build_request("mlp", {"input": np.ones((1, 256), np.float32)})
    opener = connection_opener(mode, server, ca_file)
    modes: dict[str, int] = {}

    async def one() -> None:
        channel = opener()
        try:
            await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
            connect_mode = getattr(channel, "last_connect_mode", None)
            if connect_mode is not None:
                modes[connect_mode] = modes.get(connect_mode, 0) + 1
        finally:
            await channel.close()  # QuicChannel: waits briefly for the session ticket

    await one()  # untimed: first use of the code paths; primes the ticket cache
    modes.clear()
    await asyncio.sleep(SETTLE_S)
    pid = server.process.pid
    server0 = process_cpu_seconds(pid)
    for _ in range(connections):
        await one()
    await asyncio.sleep(SETTLE_S)
    cost = ConnectionCost(
        round_,
        mode,
        connections,
        round((process_cpu_seconds(pid) - server0) / connections * 1e6, 1),
        modes,
    )
    print(
        f"  round {round_} new connection {mode:<8} server "
        f"{cost.server_cpu_us_per_connection:>6.0f} us/connection {modes or ''}",
        flush=True,
    )
    return cost


async def bench(
    server: ServerProcess, ca_file: Path, rounds: int, duration: float, connections: int
) -> tuple[list[Measurement], list[ConnectionCost]]:
    calls: list[Measurement] = []
    costs: list[ConnectionCost] = []
    for round_ in range(1, rounds + 1):
        flip = round_ % 2 == 0  # alternate which transport goes first
        for transport in reversed(TRANSPORTS) if flip else TRANSPORTS:
            calls += await measure_calls(round_, transport, server, ca_file, duration)
        for mode in reversed(CONNECTION_MODES) if flip else CONNECTION_MODES:
            costs.append(await measure_connections(round_, mode, server, ca_file, connections))
    return calls, costs


def spread(values: Sequence[float], digits: int = 0) -> str:
    """Median [lowest-highest]."""
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


def table(calls: Sequence[Measurement], costs: Sequence[ConnectionCost]) -> str:
    """Each figure as median [lowest-highest] over the rounds; ratios are taken per round."""
    by_key = {(m.round, m.transport, m.workload, m.concurrency): m for m in calls}
    rounds = sorted({m.round for m in calls})
    rows = [
        f"{len(rounds)} rounds; median [lowest-highest] over rounds; h3/h2 ratios per round",
        f"{'workload':<12} {'conc':>4} {'h2 /s':>16} {'h3 /s':>16} {'h3/h2 /s':>17} "
        f"{'server us/call h2':>18} {'h3':>16} {'h3/h2 CPU':>17} "
        f"{'client us/call h2':>18} {'h3':>16}",
    ]
    for workload, concurrency in WORKLOADS:
        pairs = [
            (by_key[r, "h2", workload, concurrency], by_key[r, "h3", workload, concurrency])
            for r in rounds
        ]
        columns = [
            spread([h2.per_second for h2, _ in pairs]),
            spread([h3.per_second for _, h3 in pairs]),
            spread([h3.per_second / h2.per_second for h2, h3 in pairs], 2),
            spread([h2.server_cpu_us_per_call for h2, _ in pairs]),
            spread([h3.server_cpu_us_per_call for _, h3 in pairs]),
            spread([h3.server_cpu_us_per_call / h2.server_cpu_us_per_call for h2, h3 in pairs], 2),
            spread([h2.client_cpu_us_per_call for h2, _ in pairs]),
            spread([h3.client_cpu_us_per_call for _, h3 in pairs]),
        ]
        widths = (16, 16, 17, 18, 16, 17, 18, 16)
        rows.append(
            f"{workload:<12} {concurrency:>4} "
            + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True))
        )
    labels = {"h3-full": "h3 full handshake", "h3-0rtt": "h3 0-RTT", "h2": "h2 (TCP, no TLS)"}
    rows += ["", f"{'new connection + 1 ModelInfer':<30} {'server us/connection':>22}"]
    for mode in CONNECTION_MODES:
        values = [c.server_cpu_us_per_connection for c in costs if c.mode == mode]
        rows.append(f"{labels[mode]:<30} {spread(values):>22}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (at least 3)")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument(
        "--connections", type=int, default=40, help="new connections per mode and round"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/transport.json"))
    args = parser.parse_args()
    if args.rounds < 1 or args.connections < 1:
        parser.error("--rounds and --connections must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        repository = model_repository(Path(tmp) / "models", ["mlp"])
        certs = Path(tmp) / "certs"
        print("starting the server (mlp only) ...", flush=True)
        server = ServerProcess(repository, Path(tmp) / "server.log", ["--certs-dir", str(certs)])
        try:
            server.wait_ready()
            print(
                f"measuring: {args.rounds} rounds, {args.duration:g} s per measurement, "
                f"{args.connections} new connections per mode",
                flush=True,
            )
            calls, costs = asyncio.run(
                bench(server, certs / "ca.pem", args.rounds, args.duration, args.connections)
            )
        finally:
            server.stop()
    print()
    print(table(calls, costs))
    write_json(args.out, [*calls, *costs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
