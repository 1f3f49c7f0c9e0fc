"""`QuicChannel(..., keepalive_s=...)` (http3.md, Reconnects): its pings keep an idle
connection open past the server's idle timeout, while a channel without them loses its
connection to that timeout. The assertion waits for the event (the other connection closed by
idleness), never for a length of time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.quic_channel import QuicChannel
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.servers import ServerProcess, model_repository, running_server

pytestmark = pytest.mark.e2e

IDLE_TIMEOUT_S = 3.0
KEEPALIVE_S = IDLE_TIMEOUT_S / 6
WAIT_S = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("keepalive")
    args = ["--certs-dir", str(certs_dir), "--idle-timeout", str(IDLE_TIMEOUT_S)]
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
