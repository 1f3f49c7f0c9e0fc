"""Many HTTP/3 connections whose streams each announce a large message and never finish it: the
server may hold what its receive budget allows (per address and in total), no more.

`python -m tests.chaos.partial_messages` measures it on a server of its own with the default
budgets: bytes the server accepted and its RSS growth, from one address or from many."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.chaos.harness import (
    MAX_MESSAGE,
    RECEIVE_BUDGET_PER_ADDRESS,
    AttackResult,
    Scale,
    Target,
    rss_mb,
)
from tests.framed_h3 import connect_from
from tests.servers import model_repository, running_server
from transport.grpc import headers as wire
from transport.h3.client import H3ClientConnection
from transport.h3.stream import H3Stream
from transport.h3.stream_state import StreamClosed

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
ATTACKER_HOST = "127.0.0.2"  # not the good clients' address (see floods.py)
STREAMS = 4  # per connection
CHUNK = 64 << 10
HEADERS_ROOM = 4 << 10  # credit a stream's HEADERS frame takes besides its message


@dataclass
class Held:
    """What an attack got: bytes the server accepted, streams it admitted and refused,
    connections it refused."""

    accepted: int
    admitted: int
    refused: int
    refused_connections: int


@dataclass
class Partial:
    """One stream of the attack: what it wrote, and whether the server refused it."""

    connection: H3ClientConnection
    stream: H3Stream
    written: int = 0

    @property
    def refused(self) -> bool:
        return self.stream.headers is not None or self.stream.error is not None

    def accepted(self) -> int:
        """What the server took of it: no more than it wrote nor than the credit it gave."""
        if self.refused:
            return 0
        quic = self.connection.protocol._quic
        return min(self.written, int(quic._streams[self.stream.stream_id].max_stream_data_remote))

    async def send(self, announced: int) -> None:
        """A message prefix announcing `announced` bytes, then as much of the message as
        credit lets through, never all of it."""
        data = b"\x00" + announced.to_bytes(4, "big")
        with contextlib.suppress(StreamClosed):
            while not self.refused and self.written + len(data) < announced:
                await self.stream.send_data(data)
                self.written += len(data)
                data = bytes(CHUNK)


async def hold_partial_messages(
    port: int, ca_file: str, hosts: list[str], connections: int, announced: int, hold_s: float
) -> Held:
    """`connections` connections from each of `hosts`, STREAMS partial messages each, held
    for `hold_s`."""
    opened: list[H3ClientConnection] = []
    refused_connections = 0
    partials: list[Partial] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        for host in hosts:
            for _ in range(connections):
                try:
                    connection = await asyncio.wait_for(connect_from(host, port, ca_file), 10)
                except (ConnectionError, TimeoutError):
                    refused_connections += 1
                    continue
                opened.append(connection)
                for _ in range(STREAMS):
                    # HEADERS at once: the next stream opened gets the next id
                    stream = connection.open_stream()
                    stream.send_headers(wire.request_headers(f"localhost:{port}", MODEL_INFER, 600))
                    partial = Partial(connection, stream)
                    partials.append(partial)
                    tasks.append(asyncio.create_task(partial.send(announced)))
        await asyncio.sleep(hold_s)
        for connection in opened:  # credit sent with the last acknowledgements arrives
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.protocol.ping(), 5)
        refused = sum(p.refused for p in partials)
        return Held(
            sum(p.accepted() for p in partials),
            len(partials) - refused,
            refused,
            refused_connections,
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for connection in opened:
            await connection.close()


async def many_connection_partial_messages(target: Target, scale: Scale) -> AttackResult:
    """From one address (not the good clients'), `scale.partial_connections` connections with
    four never-finished messages each: what the server accepted stays within the address's
    budget, the streams past it are refused RESOURCE_EXHAUSTED."""
    result = AttackResult()
    held = await hold_partial_messages(
        target.port,
        str(target.ca_file),
        [ATTACKER_HOST],
        scale.partial_connections,
        MAX_MESSAGE - 1024,
        scale.partial_hold_s,
    )
    result.outcomes["h3 RESOURCE_EXHAUSTED"] += held.refused
    result.outcomes["h3 held, unfinished"] += held.admitted
    result.outcomes["refused at transport"] += held.refused_connections
    result.outcomes = +result.outcomes  # no zero counts
    result.notes["accepted_bytes"] = held.accepted
    if held.accepted > RECEIVE_BUDGET_PER_ADDRESS + held.admitted * HEADERS_ROOM:
        result.problems.append(
            f"accepted {held.accepted} bytes from one address, past its budget "
            f"({RECEIVE_BUDGET_PER_ADDRESS})"
        )
    return result


async def _measure(args: argparse.Namespace) -> None:
    hosts = [f"127.0.0.{n}" for n in range(2, 2 + args.addresses)]
    with tempfile.TemporaryDirectory(prefix="partial-") as directory:
        root = Path(directory)
        repository = model_repository(root / "models", [])
        certs = root / "certs"
        server_args = ["--certs-dir", str(certs), "--h3-retry", "never", *args.server_args]
        with running_server(repository, root / "server.log", server_args) as server:
            pid = server.process.pid
            before = rss_mb(pid)
            peak = [before]

            async def sample() -> None:
                while True:
                    peak[0] = max(peak[0], rss_mb(pid))
                    await asyncio.sleep(0.1)

            sampler = asyncio.create_task(sample())
            started = time.monotonic()
            held = await hold_partial_messages(
                server.port,
                str(certs / "ca.pem"),
                hosts,
                args.connections,
                args.announced,
                args.hold,
            )
            sampler.cancel()
            print(
                f"{len(hosts)} address(es) x {args.connections} connections x {STREAMS} streams "
                f"announcing {args.announced} bytes, held {args.hold:g} s "
                f"({time.monotonic() - started:.0f} s in all): "
                f"accepted {held.accepted / 2**20:.1f} MiB, {held.refused} streams refused, "
                f"{held.refused_connections} connections refused, "
                f"server RSS +{peak[0] - before:.0f} MB (peak)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.partial_messages")
    parser.add_argument("--addresses", type=int, default=1, help="127.0.0.2, .3, ...")
    parser.add_argument("--connections", type=int, default=16, help="per address")
    parser.add_argument("--announced", type=int, default=60 << 20)
    parser.add_argument("--hold", type=float, default=30.0, help="seconds")
    parser.add_argument("server_args", nargs="*", help="more server flags (after --)")
    asyncio.run(_measure(parser.parse_args()))


if __name__ == "__main__":
    main()
