"""`--early-data-methods` replaces the server's list of RPCs served from 0-RTT early data
(http3.md, What may run from early data): a method it leaves out, even one of the default list,
is held until the handshake completes when it arrives as early data, then runs once; a method
it names is served from early data."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.tickets import SessionTicketCache
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1 import testing_pb2, testing_pb2_grpc
from tests.e2e.test_zero_rtt import channel, stats
from tests.servers import ServerProcess, model_repository, running_server

pytestmark = pytest.mark.e2e

UNARY = "/paddlequic.v1.Testing/Unary"
CHECK = "/grpc.health.v1.Health/Check"
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    """Only Testing/Unary may run from early data: health, of the default list, may not."""
    root = tmp_path_factory.mktemp("early-data-methods")
    args = ["--testing-service", "--certs-dir", str(certs_dir), "--early-data-methods", UNARY]
    with running_server(model_repository(root / "models", []), root / "log", args) as s:
        yield s


def held(server: ServerProcess) -> int:
    return int(stats(server).h3_handshakes["early_requests_held"])


async def test_only_the_methods_listed_are_served_from_early_data(
    server: ServerProcess, certs_dir: Path
) -> None:
    cache = SessionTicketCache()
    # The client may send either as early data: the server's list decides.
    early = frozenset({UNARY, CHECK})
    async with channel(server, certs_dir, cache, early_data_methods=early) as ch:
        await pb_grpc.GRPCInferenceServiceStub(ch).ServerLive(pb.ServerLiveRequest())
    assert ch.last_connect_mode == "full"

    before = held(server)
    async with channel(server, certs_dir, cache, early_data_methods=early) as ch:
        echo = testing_pb2.EchoRequest(payload=b"early", token="listed")
        answer = await testing_pb2_grpc.TestingStub(ch).Unary(echo, timeout=TIMEOUT_S)
        assert answer.payload == b"early"
    assert ch.last_connect_mode == "0rtt-accepted"
    assert held(server) == before  # served from the early data

    async with channel(server, certs_dir, cache, early_data_methods=early) as ch:
        check = health_pb2.HealthCheckRequest()
        answer = await health_pb2_grpc.HealthStub(ch).Check(check, timeout=TIMEOUT_S)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert ch.last_connect_mode == "0rtt-accepted"
    assert held(server) == before + 1  # left out: held for the handshake, then run
