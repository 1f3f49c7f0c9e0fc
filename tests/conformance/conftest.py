"""Transport conformance: every test runs against gRPC over HTTP/2 (grpc.aio) and gRPC over
HTTP/3 (QuicChannel) through the real server, with the generated stubs, and must pass
identically on both.

Tests are async functions that pytest-asyncio runs on an event loop of their own (loop scope
function), and create their channels inside the test: channels belong to the event loop that
made them, so no channel outlives its test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc.aio import EOF as _EOF  # type: ignore[attr-defined]

from clients.quic_channel import QuicChannel
from protos.paddlequic.v1 import control_pb2, control_pb2_grpc
from tests.servers import ServerProcess, model_repository, running_server

EOF: Any = _EOF  # grpc.aio.EOF, which grpc-stubs lack
TRANSPORTS = ("h2", "h3")
MAX_MESSAGE = 64 << 20
H2_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]
MODELS = ("mlp", "two_tower")

Channel = grpc.aio.Channel | QuicChannel
ChannelFactory = Callable[[], Channel]


def new_channel(transport: str, server: ServerProcess, ca_file: Path) -> Channel:
    """A fresh channel to `server`; call it inside the event loop that will use it."""
    if transport == "h2":
        return grpc.aio.insecure_channel(server.address, options=H2_OPTIONS)
    return QuicChannel(f"localhost:{server.port}", ca_file=str(ca_file))


STALL_ALLOWED = ("--stream-stall-timeout", "600")


@contextlib.contextmanager
def conformance_server_process(
    directory: Path,
    certs_dir: Path,
    models: Sequence[str] = MODELS,
    port: int | None = None,
    args: Sequence[str] = (),
) -> Iterator[ServerProcess]:
    """A server with the testing service and `models`, logging to directory/server.log."""
    repository = directory / "repository"
    if not repository.exists():
        model_repository(repository, models)
    extra_args = ["--testing-service", "--certs-dir", str(certs_dir), *args]
    with running_server(repository, directory / "server.log", extra_args, port) as server:
        yield server


@pytest.fixture(scope="session")
def ca_file(certs_dir: Path) -> Path:
    return certs_dir / "ca.pem"


@pytest.fixture(scope="session")
def conformance_server(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    """One server for the session's tests. Tests that read high-water counters or stop the
    server start their own. A stream's caller may pause its reading for long here
    (test_stream_backpressure pauses until the server has been quiet for many looks, longer
    than the default --stream-stall-timeout on a loaded machine)."""
    with conformance_server_process(
        tmp_path_factory.mktemp("conformance"), certs_dir, args=STALL_ALLOWED
    ) as server:
        yield server


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def make_channel(
    conformance_server: ServerProcess, transport: str, ca_file: Path
) -> ChannelFactory:
    return lambda: new_channel(transport, conformance_server, ca_file)


async def transport_stats(server: ServerProcess) -> control_pb2.TransportStatsResponse:
    """The server's HTTP/3 counters, asked over HTTP/2 so that asking opens no QUIC
    connection."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = control_pb2_grpc.ControlStub(channel)
        response: control_pb2.TransportStatsResponse = await stub.TransportStats(
            control_pb2.TransportStatsRequest(), timeout=10
        )
        return response


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, attempts: int = 500, interval: float = 0.02
) -> None:
    """Poll `check` until it holds; a bounded number of attempts, never a fixed wait."""
    for _ in range(attempts):
        if await check():
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"never happened: {what}")


def x_entries(metadata: Any) -> list[tuple[str, str | bytes]]:
    """The application's x-... entries of a metadata object, in order."""
    return [(key, value) for key, value in metadata if key.startswith("x-")]
