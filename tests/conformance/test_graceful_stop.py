"""Graceful stop (SIGTERM): in-flight calls finish, new calls are refused with UNAVAILABLE,
and the same channel object reconnects to a server started again on the same port."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from clients.quic_channel import QuicChannel
from protos.paddlequic.v1 import testing_pb2 as pb
from protos.paddlequic.v1 import testing_pb2_grpc as pb_grpc
from tests.conformance.conftest import (
    EOF,
    Channel,
    conformance_server_process,
    eventually,
    new_channel,
)
from tests.servers import ServerProcess

# Far longer than the test takes after SIGTERM on a loaded machine: the call in flight must
# finish because it ended, never be cut by the grace period (default 5 s) running out first.
# The server exiting well before it ends shows that it stops once nothing is in flight.
GRACE = ["--grace-period", "120"]


@pytest.fixture
def stoppable_server(tmp_path: Path, certs_dir: Path) -> Iterator[ServerProcess]:
    """A server of the test's own (no models: only the testing service is used)."""
    with conformance_server_process(tmp_path / "first", certs_dir, (), args=GRACE) as server:
        yield server


async def saw_goaway(channel: Channel) -> bool:
    """Whether the client learnt that the server is going away: grpc.aio's channel leaves
    READY when its transport receives GOAWAY; QuicChannel's connection records it."""
    if isinstance(channel, QuicChannel):
        connection = channel._connection
        return connection is not None and connection.protocol.goaway_stream_id is not None
    return channel.get_state() != grpc.ChannelConnectivity.READY


@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_graceful_stop_finishes_in_flight_calls_and_refuses_new_ones(
    transport: str, stoppable_server: ServerProcess, tmp_path: Path, certs_dir: Path
) -> None:
    channel = new_channel(transport, stoppable_server, certs_dir / "ca.pem")
    async with channel:
        stub = pb_grpc.TestingStub(channel)
        call = stub.BidiStream(timeout=30)
        for i in range(2):
            await call.write(pb.EchoRequest(payload=b"before %d" % i))
            assert (await call.read()).index == i

        stoppable_server.process.send_signal(15)  # SIGTERM
        await eventually(lambda: saw_goaway(channel), "the client saw GOAWAY", attempts=1000)

        # A new call after the stop began is refused.
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Unary(pb.EchoRequest(payload=b"new"), timeout=10)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE

        # The call in flight goes on and completes normally.
        for i in range(2, 4):
            await call.write(pb.EchoRequest(payload=b"after %d" % i))
            response = await call.read()
            assert (response.index, response.payload) == (i, b"after %d" % i)
        await call.done_writing()
        assert await call.read() == EOF
        assert await call.code() == grpc.StatusCode.OK

        # The server exits once nothing is in flight.
        assert await asyncio.to_thread(stoppable_server.process.wait, 30) == 0

        # Started again on the same port, the same channel object gets through.
        with conformance_server_process(
            tmp_path / "second", certs_dir, (), port=stoppable_server.port
        ):
            response = await stub.Unary(
                pb.EchoRequest(payload=b"again"), timeout=30, wait_for_ready=True
            )
            assert response.payload == b"again"
