"""`QuicChannel(..., keepalive_s=...)` (http3.md, Reconnects): its pings keep an idle
connection open past the server's idle timeout, while a channel without them loses its
connection to that timeout. The assertion waits for the event (the other connection closed by
idleness), never for a length of time. And the liveness PING of a channel whose calls wait in
silence tells the server a new address however often the client's address changes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.quic_channel import QuicChannel
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1 import testing_pb2, testing_pb2_grpc
from scripts.nat_rebinding import rebind
from tests.servers import ServerProcess, model_repository, running_server

pytestmark = pytest.mark.e2e

IDLE_TIMEOUT_S = 3.0
KEEPALIVE_S = IDLE_TIMEOUT_S / 6
WAIT_S = 60.0
# Moves faster than the channel's silence probe (0.25 s), calls answered later than a move.
MOVE_EVERY_S = 0.1
MOVES = 40
CALL_SLEEP_S = 0.3
CALLERS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("keepalive")
    args = ["--certs-dir", str(certs_dir), "--idle-timeout", str(IDLE_TIMEOUT_S)]
    args += ["--testing-service"]
    with running_server(model_repository(root / "models", []), root / "log", args) as s:
        yield s


async def test_keepalive_pings_outlive_the_servers_idle_timeout(
    server: ServerProcess, certs_dir: Path
) -> None:
    def channel(keepalive_s: float | None = None) -> QuicChannel:
        address = f"localhost:{server.port}"
        return QuicChannel(address, ca_file=str(certs_dir / "ca.pem"), keepalive_s=keepalive_s)

    # The kept-alive connection goes idle first: had its pings no effect, it would time out
    # before the other one.
    async with channel(keepalive_s=KEEPALIVE_S) as kept, channel() as idle:
        live = pb.ServerLiveRequest()
        await pb_grpc.GRPCInferenceServiceStub(kept).ServerLive(live, timeout=WAIT_S)
        kept_connection = await kept.connection()
        await pb_grpc.GRPCInferenceServiceStub(idle).ServerLive(live, timeout=WAIT_S)
        idle_connection = await idle.connection()

        await asyncio.wait_for(idle_connection.protocol.wait_closed(), WAIT_S)
        assert "Idle timeout" in str(idle_connection.protocol.terminated)
        assert kept_connection.usable
        assert (await pb_grpc.GRPCInferenceServiceStub(kept).ServerLive(live)).live
        assert await kept.connection() is kept_connection  # never reconnected


async def test_calls_go_on_while_the_clients_address_keeps_changing(
    server: ServerProcess, certs_dir: Path
) -> None:
    """Every caller waits in silence for an answer sent after the client's address changed
    (a NAT rebinding, emulated with a new socket): only the channel's PING from the new address
    tells the server where to send it. Moves every MOVE_EVERY_S, under the PING's 0.25 s of
    silence, must not put the PING off: calls are answered while the moves go on, not only
    once they stop (before the fix, none was)."""
    address = f"localhost:{server.port}"
    async with QuicChannel(address, ca_file=str(certs_dir / "ca.pem")) as channel:
        stub = testing_pb2_grpc.TestingStub(channel)
        slow = testing_pb2.EchoRequest(sleep_seconds=CALL_SLEEP_S, response_count=1)
        await stub.Unary(slow, timeout=WAIT_S)
        connection = await channel.connection()
        moving = True
        answered_while_moving = 0

        async def caller() -> None:
            nonlocal answered_while_moving
            while moving:
                await stub.Unary(slow, timeout=WAIT_S)
                answered_while_moving += moving

        callers = [asyncio.create_task(caller()) for _ in range(CALLERS)]
        await asyncio.sleep(CALL_SLEEP_S)  # every caller waits for an answer
        answered_while_moving = 0
        for _ in range(MOVES):
            await rebind(channel)
            await asyncio.sleep(MOVE_EVERY_S)
        moving = False
        await asyncio.gather(*callers)
        assert answered_while_moving > 0
        assert await channel.connection() is connection  # never reconnected
