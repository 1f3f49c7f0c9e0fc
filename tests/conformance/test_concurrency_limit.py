"""--max-concurrent-rpcs: calls past the cap are refused with RESOURCE_EXHAUSTED on both
transports, and the server takes calls again once running ones finish."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from protos.paddlequic.v1 import testing_pb2 as pb
from protos.paddlequic.v1 import testing_pb2_grpc as pb_grpc
from tests.conformance.conftest import H2_OPTIONS, Channel, eventually, new_channel
from tests.e2e.test_frontends import frontends, wait_for
from tests.servers import ServerProcess, running_server

CAP = 2


@contextlib.contextmanager
def capped(directory: Path, certs_dir: Path, cap: int, *args: str) -> Iterator[ServerProcess]:
    repository = directory / "repository"
    repository.mkdir()
    extra_args = ["--testing-service", "--certs-dir", str(certs_dir)]
    extra_args += ["--max-concurrent-rpcs", str(cap), *args]
    with running_server(repository, directory / "server.log", extra_args) as server:
        yield server


@pytest.fixture(scope="module")
def capped_server(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    with capped(tmp_path_factory.mktemp("capped"), certs_dir, CAP) as server:
        yield server


async def test_calls_past_the_cap_are_refused(
    capped_server: ServerProcess, transport: str, ca_file: Path
) -> None:
    async with new_channel(transport, capped_server, ca_file) as channel:
        stub = pb_grpc.TestingStub(channel)
        # Bidirectional streams the server keeps running until the client finishes them:
        # once each has answered a message, its handler runs. A stream may be refused while
        # the server still counts a call that has just ended (the fixture's readiness probes,
        # the other transport's test): it is opened again until it runs.
        running = []
        for _ in range(CAP):

            async def held() -> bool:
                call = stub.BidiStream(timeout=60)
                try:
                    await call.write(pb.EchoRequest(payload=b"hold"))
                    assert (await call.read()).payload == b"hold"
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    return False
                running.append(call)
                return True

            await eventually(held, "a stream runs below the cap")

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


@pytest.fixture(scope="module")
def capped_frontends(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("capped-frontends")
    with capped(directory, certs_dir, HOST_CAP, "--frontends", "2") as server:
        yield server


HOST_CAP = 3
PROBES = 8


def own_connection(transport: str, server: ServerProcess, ca_file: Path) -> Channel:
    """A channel on a connection of its own (grpc shares one between a process's channels
    unless told not to), so the kernel may give each channel another front-end."""
    if transport == "h2":
        options = [*H2_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        return grpc.aio.insecure_channel(server.address, options=options)
    return new_channel(transport, server, ca_file)


async def test_with_frontends_the_cap_is_the_host_s(
    capped_frontends: ServerProcess, transport: str, ca_file: Path
) -> None:
    """`--frontends 2`: HOST_CAP calls held on connections of their own (spread over the
    front-ends by the kernel), then a call on each of PROBES more connections is refused,
    whichever front-end holds it: each counts what the others run."""
    server = capped_frontends
    holders = [own_connection(transport, server, ca_file) for _ in range(HOST_CAP)]
    running = [pb_grpc.TestingStub(channel).BidiStream(timeout=60) for channel in holders]
    for call in running:
        await call.write(pb.EchoRequest(payload=b"hold"))
        assert (await call.read()).payload == b"hold"
    for _ in range(PROBES):
        probe = own_connection(transport, server, ca_file)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.TestingStub(probe).Unary(pb.EchoRequest(payload=b"over"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await probe.close(None)
    for call in running:
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    probe = own_connection(transport, server, ca_file)

    async def served_again() -> bool:
        try:
            await pb_grpc.TestingStub(probe).Unary(pb.EchoRequest(payload=b"again"), timeout=10)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            return False
        return True

    await eventually(served_again, "a call is served once the held ones finished")
    for channel in [*holders, probe]:
        await channel.close(None)


async def hold(channels: list[Channel]) -> list[Any]:
    """A BidiStream on each channel, running (it answered a message); a front-end that is
    starting is waited for."""
    stubs = [pb_grpc.TestingStub(channel) for channel in channels]
    calls = [stub.BidiStream(timeout=60, wait_for_ready=True) for stub in stubs]
    for call in calls:
        await call.write(pb.EchoRequest(payload=b"hold"))
        assert (await call.read()).payload == b"hold"
    return calls


async def test_a_killed_front_end_s_calls_stop_counting(tmp_path: Path, certs_dir: Path) -> None:
    """What a killed front-end counted dies with it (its parent clears its block, and its
    successor starts from an empty one): with the cap's calls held when every front-end is
    killed, the new ones take the cap's calls again, and refuse one more."""
    with capped(tmp_path, certs_dir, HOST_CAP, "--frontends", "2", "--no-h3") as server:
        before = frontends(server)
        channels = [own_connection("h2", server, Path()) for _ in range(HOST_CAP)]
        await hold(channels)
        for pid in before:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: len(frontends(server) - before) == 2, "two new front-ends")
        for channel in channels:
            await channel.close(None)
        channels = [own_connection("h2", server, Path()) for _ in range(HOST_CAP + 1)]
        calls = await hold(channels[:HOST_CAP])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.TestingStub(channels[-1]).Unary(
                pb.EchoRequest(payload=b"over"), timeout=30, wait_for_ready=True
            )
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in calls:
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
        for channel in channels:
            await channel.close(None)
