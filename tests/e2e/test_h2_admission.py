"""HTTP/2 connection bounds: --h2-max-connections closes connections past the limit as they
arrive while the ones held keep working (per process: grpc core counts them, so with
--frontends N each front-end holds the limit, N times it in all), and --idle-timeout closes a
connection with no call."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.conformance.conftest import eventually
from tests.servers import running_server

pytestmark = pytest.mark.e2e

LIMIT = 2
# Channels to one target share a connection in a process unless each has its own pool.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def _channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=OWN_CONNECTION)


async def _live(channel: grpc.aio.Channel) -> bool:
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    response: pb.ServerLiveResponse = await stub.ServerLive(pb.ServerLiveRequest(), timeout=10)
    return response.live


async def test_connections_past_the_limit_are_closed(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    # One process (whatever PADDLEQUIC_FRONTENDS says): with front-ends the kernel spreads the
    # connections over them, and the one past the limit may reach another (the test below).
    args = ["--no-h3", "--h2-max-connections", str(LIMIT), "--frontends", "1"]
    with running_server(tmp_path / "models", tmp_path / "server.log", args) as server:
        # The fixture's own channel holds one of the connections.
        held = [_channel(server.address) for _ in range(LIMIT - 1)]
        for channel in held:
            assert await _live(channel)
        extra = _channel(server.address)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _live(extra)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        await extra.close(None)
        for channel in held:  # the connections held are unaffected
            assert await _live(channel)
        server.channel.close()

        async def admitted() -> bool:
            async with _channel(server.address) as channel:
                try:
                    return await _live(channel)
                except grpc.aio.AioRpcError:
                    return False

        await eventually(admitted, "a connection admitted once one closed", attempts=100)
        for channel in held:
            await channel.close(None)


async def test_with_front_ends_each_holds_the_limit(tmp_path: Path) -> None:
    """`--frontends 2`: at most twice the limit in all (docs/configuration.md), and no fewer
    than one front-end's worth, however the kernel spreads the connections."""
    (tmp_path / "models").mkdir()
    args = ["--no-h3", "--h2-max-connections", str(LIMIT), "--frontends", "2"]
    with running_server(tmp_path / "models", tmp_path / "server.log", args) as server:
        channels = [_channel(server.address) for _ in range(3 * LIMIT)]
        admitted = 0
        for channel in channels:
            try:
                admitted += await _live(channel)
            except grpc.aio.AioRpcError as refused:
                assert refused.code() == grpc.StatusCode.UNAVAILABLE
        # The fixture's own channel holds a connection of one of the front-ends.
        assert LIMIT - 1 <= admitted <= 2 * LIMIT - 1, admitted
        for channel in channels:
            await channel.close(None)


async def test_an_idle_connection_is_closed(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    # The only thing that happens after the idle timeout is what the test waits for (nothing
    # is asserted about the connection before it, however slow the machine), with a deadline
    # a hundred times longer.
    args = ["--no-h3", "--idle-timeout", "0.5"]
    with running_server(tmp_path / "models", tmp_path / "server.log", args) as server:
        async with _channel(server.address) as channel:
            assert await _live(channel)  # connected: READY until the server closes it

            async def closed_by_server() -> bool:
                return channel.get_state() != grpc.ChannelConnectivity.READY

            await eventually(closed_by_server, "the idle connection closed", interval=0.1)
            assert await _live(channel)  # the client reconnects transparently
