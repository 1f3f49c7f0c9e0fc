"""What the HTTP/3 server admits from an untrusted network: connection limits in total and
per address, half-open connections dropped after the handshake timeout, and QUIC Retry
(always, or automatically under a flood of half-open connections) with 0-RTT still working.

Half-open connections are made by hand: a real aioquic client connection whose Initial is
sent from a UDP socket bound to a chosen loopback address, and never continued."""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from aioquic.buffer import Buffer  # type: ignore[attr-defined]
from aioquic.h3.connection import H3_ALPN
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode, QuicPacketType, pull_quic_header
from grpc.aio import AioRpcError

from clients.quic_channel import QuicChannel
from clients.tickets import SessionTicketCache
from protos.inference import grpc_service_pb2 as inference_pb2
from protos.inference import grpc_service_pb2_grpc as inference_grpc
from protos.paddlequic.v1 import control_pb2
from tests.conformance.conftest import eventually
from tests.servers import ServerProcess, model_repository, running_server


@contextlib.contextmanager
def h3_server(root: Path, certs_dir: Path, args: Sequence[str]) -> Iterator[ServerProcess]:
    repository = model_repository(root / "models", [])
    with running_server(repository, root / "log", ["--certs-dir", str(certs_dir), *args]) as server:
        yield server


def refusals(server: ServerProcess) -> dict[str, int]:
    response: control_pb2.TransportStatsResponse = server.control.TransportStats(
        control_pb2.TransportStatsRequest(), timeout=5
    )
    return dict(response.h3_refusals)


HANDSHAKE_TIMEOUT_S = 5


class HalfOpen:
    """A connection attempt from `host` that sends its Initial (with `token`) and nothing
    else."""

    def __init__(self, port: int, host: str, token: bytes = b"") -> None:
        self.quic = QuicConnection(
            configuration=QuicConfiguration(
                is_client=True, alpn_protocols=H3_ALPN, verify_mode=ssl.CERT_NONE, token=token
            )
        )
        self.server = ("127.0.0.1", port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.sock.settimeout(10)
        self.quic.connect(self.server, now=time.monotonic())
        for data, _ in self.quic.datagrams_to_send(now=time.monotonic()):
            self.sock.sendto(data, self.server)

    def answer(self) -> tuple[QuicPacketType, events.ConnectionTerminated | None]:
        """The server's first datagram: its packet type, and the close it carries if any."""
        data = self.sock.recv(65536)
        header = pull_quic_header(Buffer(data=data), host_cid_length=8)
        now = time.monotonic()
        self.quic.receive_datagram(data, self.server, now=now)
        # A close is reported once the draining period (3 PTO, under a second) has passed;
        # the idle timeout (60 s) is far off.
        self.quic.handle_timer(now=now + 5)
        closed = None
        while (event := self.quic.next_event()) is not None:
            if isinstance(event, events.ConnectionTerminated):
                closed = event
        return header.packet_type, closed

    def close(self) -> None:
        self.sock.close()


async def server_live(server: ServerProcess, certs_dir: Path, **kw: object) -> QuicChannel:
    """A new channel that made one call (kept open, so its connection stays)."""
    channel = QuicChannel(f"localhost:{server.port}", ca_file=str(certs_dir / "ca.pem"), **kw)  # type: ignore[arg-type]
    stub = inference_grpc.GRPCInferenceServiceStub(channel)
    await stub.ServerLive(inference_pb2.ServerLiveRequest(), timeout=20)
    return channel


async def test_the_connection_over_the_per_address_limit_is_refused(
    tmp_path: Path, certs_dir: Path
) -> None:
    args = ["--h3-max-connections-per-address", "2", "--h3-retry", "never"]
    with h3_server(tmp_path, certs_dir, args) as server:
        first = await server_live(server, certs_dir)
        second = await server_live(server, certs_dir)
        with pytest.raises(AioRpcError) as refused:
            await server_live(server, certs_dir)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "too many connections" in (refused.value.details() or "")
        for channel in (first, second):  # the first two are unaffected
            stub = inference_grpc.GRPCInferenceServiceStub(channel)
            live = await stub.ServerLive(inference_pb2.ServerLiveRequest(), timeout=20)
            assert live.live
            await channel.close()
        assert refusals(server)["connections_per_address"] >= 1


async def test_total_limit_and_handshake_timeout(tmp_path: Path, certs_dir: Path) -> None:
    # Long enough that no half-open connection is dropped before the fourth is refused, however
    # slow the machine; the drop is then waited for with a deadline ten times longer.
    args = [
        "--h3-max-connections",
        "3",
        "--h3-handshake-timeout",
        str(HANDSHAKE_TIMEOUT_S),
        "--h3-retry",
        "never",
    ]
    with h3_server(tmp_path, certs_dir, args) as server:
        half_open = [HalfOpen(server.port, f"127.0.0.{n}") for n in (2, 3, 4)]
        for attempt in half_open:
            packet_type, closed = attempt.answer()
            assert packet_type == QuicPacketType.INITIAL and closed is None  # admitted
        extra = HalfOpen(server.port, "127.0.0.5")
        _, closed = extra.answer()
        assert closed is not None and closed.error_code == QuicErrorCode.CONNECTION_REFUSED
        assert refusals(server)["connections"] == 1

        # Never completed: dropped after the handshake timeout, which makes room again.
        async def dropped() -> bool:
            return refusals(server).get("handshake_timeout") == 3

        await eventually(dropped, "half-open connections dropped", attempts=500, interval=0.1)

        async def admitted() -> bool:
            try:
                channel = await server_live(server, certs_dir)
            except AioRpcError:
                return False
            await channel.close()
            return True

        await eventually(admitted, "a new connection is admitted", attempts=20, interval=0.05)
        for attempt in [*half_open, extra]:
            attempt.close()


async def test_retry_always_keeps_zero_rtt(tmp_path: Path, certs_dir: Path) -> None:
    with h3_server(tmp_path, certs_dir, ["--h3-retry", "always"]) as server:
        cache = SessionTicketCache()
        key = SessionTicketCache.key("localhost", "localhost", server.port)

        async def connect_once() -> str | None:
            # Without the server's address token (as from another address, or once it
            # expired), each connection gets a Retry and resumes after it.
            cache.take_token(key)
            channel = await server_live(server, certs_dir, ticket_cache=cache)
            await channel.close()
            return channel.last_connect_mode

        modes = [await connect_once() for _ in range(3)]
        assert modes == ["full", "0rtt-accepted", "0rtt-accepted"]
        assert refusals(server)["retry"] >= 3


async def test_retry_auto_starts_under_a_flood_of_half_open_connections(
    tmp_path: Path, certs_dir: Path
) -> None:
    """The server's threshold: Retry once 64 handshakes are unfinished."""
    with h3_server(tmp_path, certs_dir, ["--h3-max-connections-per-address", "100"]) as server:
        flood = [HalfOpen(server.port, "127.0.0.2") for _ in range(64)]
        for attempt in flood:
            assert attempt.answer()[0] == QuicPacketType.INITIAL  # no Retry below the threshold
        probe = HalfOpen(server.port, "127.0.0.3")
        assert probe.answer()[0] == QuicPacketType.RETRY

        # A real client follows the Retry and is served.
        channel = await server_live(server, certs_dir)
        await channel.close()
        assert refusals(server)["retry"] >= 2
        for attempt in [*flood, probe]:
            attempt.close()
