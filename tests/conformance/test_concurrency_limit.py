"""--max-concurrent-rpcs: calls past the cap are refused with RESOURCE_EXHAUSTED on both
transports, and the server takes calls again once running ones finish."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from protos.paddlequic.v1 import testing_pb2 as pb
from protos.paddlequic.v1 import testing_pb2_grpc as pb_grpc
from tests.conformance.conftest import eventually, new_channel
from tests.servers import ServerProcess, running_server

CAP = 2


@pytest.fixture(scope="module")
def capped_server(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("capped")
    repository = directory / "repository"
    repository.mkdir()
    extra_args = [
        "--testing-service",
        "--certs-dir",
        str(certs_dir),
        "--max-concurrent-rpcs",
        str(CAP),
    ]
    with running_server(repository, directory / "server.log", extra_args) as server:
        yield server


async def test_calls_past_the_cap_are_refused(
    capped_server: ServerProcess, transport: str, ca_file: Path
) -> None:
    async with new_channel(transport, capped_server, ca_file) as channel:
        stub = pb_grpc.TestingStub(channel)
        # Bidirectional streams the server keeps running until the client finishes them:
        # once each has answered a message, its handler runs.
        running = [stub.BidiStream(timeout=60) for _ in range(CAP)]
        for call in running:
            await call.write(pb.EchoRequest(payload=b"hold"))
            assert (await call.read()).payload == b"hold"

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Unary(pb.EchoRequest(payload=b"one too many"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        for call in running:
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK

        async def served_again() -> bool:
            try:
                response = await stub.Unary(pb.EchoRequest(payload=b"again"), timeout=10)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False
            served: bool = response.payload == b"again"
            return served

        await eventually(served_again, "a call is served once the running ones finished")
