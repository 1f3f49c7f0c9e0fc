"""Restricted protocols leave server reflection open (security.md: grpcurl needs it to build
the call that carries the header), and the `health` category, Triton's and grpc.health.v1's,
can be restricted: on both transports, with reflection clients and with the real grpcurl."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.grpc.reflection.v1 import reflection_pb2 as v1_pb2
from protos.grpc.reflection.v1 import reflection_pb2_grpc as v1_grpc
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.e2e.test_security import Restricted, channel
from tests.interop.test_grpcurl import GRPCURL, GRPCURL_TIMEOUT_S
from tests.servers import model_repository, running_server, wait_logged

pytestmark = pytest.mark.e2e

SECRET = "health-Secret-5e1d"
HEADER = ("triton-grpc-protocol-health-key", SECRET)
TIMEOUT_S = 30.0
# grpcurl exits with 64 + the gRPC status code when a call fails.
UNAUTHENTICATED_EXIT = 64 + grpc.StatusCode.UNAUTHENTICATED.value[0]
METHOD = "grpc.health.v1.Health/Check"


@pytest.fixture(scope="module")
def restricted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Restricted]:
    """Every category but the open `inference`, `model-config` and `statistics` restricted:
    no model is needed to call what is left."""
    root = tmp_path_factory.mktemp("reflection")
    certs = root / "certs"
    args = [
        "--certs-dir",
        str(certs),
        "--restricted-protocol",
        f"health,metadata,model-repository,control:health-key={SECRET}",
    ]
    repository = model_repository(root / "models", [])
    with running_server(repository, root / "log", args, wait=False) as s:
        # ServerReady is restricted here: the log tells when the server is ready.
        wait_logged(s, "ready: 0 model version(s) loaded")
        yield Restricted(s, certs)


@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_reflection_stays_open_and_health_is_restricted(
    restricted: Restricted, transport: str
) -> None:
    async with channel(restricted, transport) as ch:
        reflection = v1_grpc.ServerReflectionStub(ch)
        asked = [
            v1_pb2.ServerReflectionRequest(list_services=""),
            v1_pb2.ServerReflectionRequest(file_containing_symbol="grpc.health.v1.Health"),
        ]
        answers = [a async for a in reflection.ServerReflectionInfo(iter(asked), timeout=TIMEOUT_S)]
        listed = {s.name for s in answers[0].list_services_response.service}
        assert {"grpc.health.v1.Health", "inference.GRPCInferenceService"} <= listed
        assert answers[1].file_descriptor_response.file_descriptor_proto

        health = health_pb2_grpc.HealthStub(ch)
        inference = pb_grpc.GRPCInferenceServiceStub(ch)
        check = health_pb2.HealthCheckRequest()
        for refused in (
            health.Check(check, timeout=TIMEOUT_S),
            health.Check(check, metadata=[(HEADER[0], SECRET + "x")], timeout=TIMEOUT_S),
            inference.ServerLive(pb.ServerLiveRequest(), timeout=TIMEOUT_S),
            inference.ServerReady(pb.ServerReadyRequest(), timeout=TIMEOUT_S),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await refused
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        watch = health.Watch(check, timeout=TIMEOUT_S)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await watch.read()
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED

        served = await health.Check(check, metadata=[HEADER], timeout=TIMEOUT_S)
        assert served.status == health_pb2.HealthCheckResponse.SERVING
        live = await inference.ServerLive(pb.ServerLiveRequest(), metadata=[HEADER])
        assert live.live


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl is not installed (dev extra)")
def test_grpcurl_builds_the_call_through_open_reflection(restricted: Restricted) -> None:
    """`-rpc-header` goes on the call only, not on grpcurl's reflection requests."""
    assert GRPCURL is not None

    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        command = [str(GRPCURL), "-plaintext", *flags, restricted.server.address, METHOD]
        return subprocess.run(command, capture_output=True, text=True, timeout=GRPCURL_TIMEOUT_S)

    refused = run()
    assert refused.returncode == UNAUTHENTICATED_EXIT, refused.stderr
    assert "expecting header 'triton-grpc-protocol-health-key'" in refused.stderr
    served = run("-rpc-header", f"{HEADER[0]}: {SECRET}")
    assert served.returncode == 0, served.stderr
    assert '"status": "SERVING"' in served.stdout
