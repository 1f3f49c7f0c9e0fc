"""`make lab-migration`: a client whose address changes mid-call keeps its calls.

The RTT lab's link (two network namespaces, a forwarder delaying every packet) with the real
server (`--frontends 1`, then `2`) in one namespace and a client in the other. The client keeps
CALLERS unary ModelInfer calls going in a closed loop and one ModelStreamInfer call exchanging
a message at a time, all on one QuicChannel, while its address changes MOVES times:

- rebind: a NAT rebinding, same IP and a new source port (scripts/nat_rebinding.py);
- move:   the client gets an address in another subnet, its route to the server switches to
          it and the old address is removed, as when a device leaves one network for another
          (both addresses sit on the same emulated link, so the same delay).

The server sees its connection arrive from a new address: it validates the new path
(PATH_CHALLENGE), within the anti-amplification limit until then; with `--frontends 2` the new
address may hash to the other front-end, which passes the datagrams on to the owner
(transport/h3/datagram_routing.py; counted by paddlequic_frontend_datagrams_forwarded).

Per scenario, `--frontends` and RTT: calls completed, calls lost (failed, or past their
CALL_DEADLINE_S), whether the connection survived, the median and p99 latency of the calls
away from the moves (the steady state, and the noise of a busy machine), and the p99 and max
of the calls across a move (in flight at it, or started up to WINDOW_S after).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scripts.rtt_lab import (
    CLIENT_IP,
    PREFIX_LENGTH,
    REPO_ROOT,
    SERVER_IP,
    SERVER_NAME,
    SERVER_PORT,
    TUN_NAME,
    Link,
    _ip,
    _preflight,
    _request,
    _start_server,
    _stop,
    _wait_server,
    check_link,
)

SCENARIOS = ("rebind", "move")
CALLERS = 4
CALL_DEADLINE_S = 5.0  # a call not answered by then is lost
WARM_S = 1.0  # calls before the first move
WINDOW_S = 0.1  # calls started this long after a move still count as across it
REPORT_WAITS = 5  # front-end reports waited for, at most, for the forwarded count to move
METRICS_PORT = 8002  # the server's default, on its namespace's loopback
_DONE = "done"


def client_address(move: int) -> str:
    """The client's address after `move` moves (0: the link's own), each in a subnet of its
    own; the server namespace routes 198.18.0.0/16 over the link."""
    return CLIENT_IP if move == 0 else f"198.18.{move}.2"


# --- the client (runs in the client namespace) ----------------------------------------------


@dataclass
class Call:
    kind: str  # "unary", or "stream": one message exchanged on the streaming call
    start: float
    end: float
    error: str  # "" when answered


async def _drive(
    target: str, ca_file: str, scenario: str, moves: int, every_s: float
) -> dict[str, Any]:
    import grpc
    from grpc.aio import EOF  # type: ignore[attr-defined]

    from clients.quic_channel import QuicChannel
    from protos.inference import grpc_service_pb2_grpc as pb_grpc
    from scripts.nat_rebinding import rebind

    request = _request()
    calls: list[Call] = []
    stop = asyncio.Event()
    async with QuicChannel(target, ca_file=ca_file, server_name=SERVER_NAME) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await stub.ModelInfer(request, timeout=CALL_DEADLINE_S)
        connection = await channel.connection()

        async def unary() -> None:
            while not stop.is_set():
                start = time.monotonic()
                error = ""
                try:
                    await stub.ModelInfer(request, timeout=CALL_DEADLINE_S)
                except grpc.aio.AioRpcError as exc:
                    error = exc.code().name
                calls.append(Call("unary", start, time.monotonic(), error))

        async def stream() -> None:
            call = stub.ModelStreamInfer()
            try:
                while not stop.is_set():
                    start = time.monotonic()
                    await call.write(request)
                    response = await asyncio.wait_for(call.read(), CALL_DEADLINE_S)
                    error = "" if response is not EOF else "EOF"
                    error = error or response.error_message
                    calls.append(Call("stream", start, time.monotonic(), error))
                    if error:
                        return
                await call.done_writing()
            except (grpc.aio.AioRpcError, TimeoutError) as exc:
                name = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "DEADLINE"
                calls.append(Call("stream", start, time.monotonic(), name))
            finally:
                call.cancel()

        tasks = [asyncio.create_task(unary()) for _ in range(CALLERS)]
        tasks.append(asyncio.create_task(stream()))
        await asyncio.sleep(WARM_S)
        windows = []
        for move in range(1, moves + 1):
            began = time.monotonic()
            if scenario == "rebind":
                await rebind(channel)
            else:
                await _ask_lab(f"move {move}")
            windows.append((began, time.monotonic()))
            await asyncio.sleep(every_s)
        stop.set()
        await asyncio.gather(*tasks)
        kept = connection.usable and await channel.connection() is connection
    return {"calls": [asdict(c) for c in calls], "moves": windows, "kept_connection": kept}


async def _ask_lab(line: str) -> None:
    """The lab moves the client's address and answers."""
    print(line, flush=True)
    if (await asyncio.to_thread(sys.stdin.readline)).strip() != _DONE:
        raise RuntimeError(f"the lab did not do {line!r}")


# --- the lab (root namespace) ---------------------------------------------------------------


class MigrationLink(Link):
    """The RTT lab's link, with the server namespace routing the whole 198.18.0.0/16 over it,
    so the client may take addresses in other subnets."""

    def _connect(self) -> None:
        super()._connect()
        _ip("-n", self.namespaces["server"], "route", "add", "198.18.0.0/16", "dev", TUN_NAME)

    def move_client(self, move: int) -> None:
        """From `client_address(move - 1)` to `client_address(move)`: the new address comes
        up, the route to the server takes it as source, the old one goes."""
        client = self.namespaces["client"]
        new = client_address(move)
        _ip("-n", client, "addr", "add", f"{new}/{PREFIX_LENGTH}", "dev", TUN_NAME)
        _ip("-n", client, "route", "replace", f"{SERVER_IP}/32", "dev", TUN_NAME, "src", new)
        old = client_address(move - 1)
        _ip("-n", client, "addr", "del", f"{old}/{PREFIX_LENGTH}", "dev", TUN_NAME)

    def restore_client(self, moves: int) -> None:
        """Back to the link's own address, as before the first move."""
        if moves == 0:
            return
        client = self.namespaces["client"]
        _ip("-n", client, "addr", "add", f"{CLIENT_IP}/{PREFIX_LENGTH}", "dev", TUN_NAME)
        _ip("-n", client, "route", "del", f"{SERVER_IP}/32")
        last = client_address(moves)
        _ip("-n", client, "addr", "del", f"{last}/{PREFIX_LENGTH}", "dev", TUN_NAME)


def forwarded_datagrams(metrics: str) -> float:
    """paddlequic_frontend_datagrams_forwarded in a /metrics page (0 before any report)."""
    found = re.search(r"^paddlequic_frontend_datagrams_forwarded_total (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


def _forwarded_since(link: Link, before: float) -> float:
    """Datagrams forwarded since `before` was read. The front-ends report every
    REPORT_EVERY_S; on a busy machine a report can come late, so this waits for a count that
    moved, up to REPORT_WAITS reports, then takes what is there."""
    from service.frontends.frontend import REPORT_EVERY_S

    crossed = 0.0
    for _ in range(REPORT_WAITS):
        time.sleep(REPORT_EVERY_S + 0.5)
        crossed = forwarded(link) - before
        if crossed > 0:
            break
    return crossed


def forwarded(link: Link) -> float:
    """Datagrams forwarded so far, read from the server's /metrics in its namespace."""
    with link.open_socket("server") as sock:
        sock.settimeout(5)
        sock.connect(("127.0.0.1", METRICS_PORT))
        sock.sendall(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        page = b"".join(iter(lambda: sock.recv(65536), b"")).decode()
    return forwarded_datagrams(page)


def _run_client(
    link: MigrationLink, ca_file: Path, scenario: str, moves: int, every_s: float
) -> dict[str, Any]:
    command = [
        *link.exec_prefix("client"),
        *(sys.executable, "-m", "scripts.migration_lab", "client"),
        f"--target={SERVER_IP}:{SERVER_PORT}",
        f"--ca={ca_file}",
        f"--scenario={scenario}",
        f"--moves={moves}",
        f"--every={every_s}",
    ]
    moved = 0
    with subprocess.Popen(
        command, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as client:
        assert client.stdin is not None and client.stdout is not None
        try:
            while (line := client.stdout.readline().strip()).startswith("move "):
                moved = int(line.split()[1])
                link.move_client(moved)
                client.stdin.write(_DONE + "\n")
                client.stdin.flush()
            out = line
        finally:
            if client.wait(60) != 0:
                raise RuntimeError(f"the lab's client failed ({client.returncode})")
            link.restore_client(moved)
    result: dict[str, Any] = json.loads(out)
    return result


@dataclass
class Row:
    scenario: str
    frontends: int
    rtt_ms: float
    moves: int
    completed: int  # calls answered (unary calls and streaming-call messages)
    lost: int  # failed or past their deadline
    errors: list[str]
    stream_messages: int
    kept_connection: bool
    across: int  # calls across a move
    steady_median_ms: float  # the calls away from the moves
    steady_p99_ms: float
    across_p99_ms: float
    across_max_ms: float
    extra_max_ms: float  # across_max_ms - steady_median_ms
    typical_move_ms: float  # the median over the moves of each one's slowest call
    forwarded_datagrams: float  # passed from one front-end to the other
    slowest_per_move_ms: list[float]


def row(
    scenario: str, frontends: int, rtt_ms: float, result: dict[str, Any], crossed: float
) -> Row:
    calls = [Call(**c) for c in result["calls"]]
    windows = [tuple(w) for w in result["moves"]]
    answered = [c for c in calls if not c.error]
    slowest = [0.0] * len(windows)
    across: list[float] = []
    steady: list[float] = []
    for c in answered:
        latency = (c.end - c.start) * 1e3
        moved = [c.start < end + WINDOW_S and c.end > began for began, end in windows]
        for i in (i for i, hit in enumerate(moved) if hit):
            slowest[i] = max(slowest[i], latency)
        (across if any(moved) else steady).append(latency)
    median = statistics.median(steady)
    worst = max(across, default=0.0)
    return Row(
        scenario,
        frontends,
        rtt_ms,
        len(windows),
        len(answered),
        len(calls) - len(answered),
        sorted({c.error for c in calls if c.error}),
        sum(c.kind == "stream" and not c.error for c in calls),
        bool(result["kept_connection"]),
        len(across),
        round(median, 2),
        round(_p99(steady), 2),
        round(_p99(across), 2),
        round(worst, 2),
        round(worst - median, 2),
        round(statistics.median(slowest), 2) if slowest else 0.0,
        crossed,
        [round(v, 2) for v in slowest],
    )


def _p99(values: list[float]) -> float:
    if len(values) < 2:
        return max(values, default=0.0)
    return statistics.quantiles(values, n=100, method="inclusive")[-1]


def run_lab(
    scenarios: Sequence[str],
    frontends: Sequence[int],
    rtts: Sequence[float],
    moves: int,
    every_s: float,
) -> list[Row]:
    rows: list[Row] = []
    for count in frontends:
        with (
            tempfile.TemporaryDirectory(prefix="migration-lab-") as name,
            MigrationLink(rtts[0] / 2, prefix="pqmig") as link,
        ):
            tmp = Path(name)
            ca_file = tmp / "certs" / "ca.pem"
            log_path = tmp / "server.log"
            with log_path.open("wb") as log:
                server = _start_server(link, tmp, log, ["--frontends", str(count)])
                try:
                    _wait_server(link, server, ca_file, log_path)
                    for rtt in rtts:
                        link.set_delay(rtt / 2)
                        check_link(link, rtt)
                        for scenario in scenarios:
                            before = forwarded(link) if count > 1 else 0.0
                            result = _run_client(link, ca_file, scenario, moves, every_s)
                            # One front-end forwards nothing.
                            crossed = _forwarded_since(link, before) if count > 1 else 0.0
                            rows.append(row(scenario, count, rtt, result, crossed))
                            print(table(rows[-1:]).splitlines()[-1], flush=True)
                finally:
                    _stop(server)
    return rows


def table(rows: Sequence[Row]) -> str:
    lines = [
        "scenario frontends RTT ms moves | completed lost kept | steady median  p99 ms "
        "| across n  p99 ms  max ms  extra ms | typical move ms | forwarded"
    ]
    for r in rows:
        lines.append(
            f"{r.scenario:<8} {r.frontends:>9} {r.rtt_ms:>6g} {r.moves:>5} | "
            f"{r.completed:>9} {r.lost:>4} {'yes' if r.kept_connection else 'NO':>4} | "
            f"{r.steady_median_ms:>13.1f} {r.steady_p99_ms:>7.1f} | "
            f"{r.across:>8} {r.across_p99_ms:>7.1f} "
            f"{r.across_max_ms:>7.1f} {r.extra_max_ms:>9.1f} | {r.typical_move_ms:>15.1f} | "
            f"{r.forwarded_datagrams:>9g}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--frontends", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rtts", type=float, nargs="+", default=[0.0, 20.0], help="ms")
    parser.add_argument("--moves", type=int, default=4, help="address changes per run")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between moves")
    parser.add_argument("--out", type=Path, default=Path("bench-results/migration.json"))
    commands = parser.add_subparsers(dest="command", metavar="{client}")
    client = commands.add_parser("client", help="internal: runs in the client namespace")
    client.add_argument("--target", required=True)
    client.add_argument("--ca", required=True)
    client.add_argument("--scenario", choices=SCENARIOS, required=True)
    client.add_argument("--moves", type=int, required=True)
    client.add_argument("--every", type=float, required=True)
    args = parser.parse_args(argv)
    if args.command == "client":
        result = asyncio.run(_drive(args.target, args.ca, args.scenario, args.moves, args.every))
        json.dump(result, sys.stdout)
        return 0
    problem = _preflight()
    if problem is not None:
        print(f"migration_lab: {problem}", file=sys.stderr)
        return 2
    rows = run_lab(args.scenarios, args.frontends, args.rtts, args.moves, args.every)
    print()
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0 if all(r.lost == 0 and r.kept_connection for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
