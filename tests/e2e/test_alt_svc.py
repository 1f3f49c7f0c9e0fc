"""Alt-Svc against the real server: each HTTP/2 connection is told of HTTP/3 on its port, and
auto:// clients move there, race a new connection, and fall back to HTTP/2 when HTTP/3 does
not answer (here a UDP socket that reads nothing; tests/lab blocks UDP on a real link)."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import AsyncInferenceClient, build_request
from clients.transport_policy import TransportPolicy
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.servers import REPO_ROOT, ServerProcess, free_port, model_repository, running_server
from transport.grpc.alt_svc import HEADER, h3_header

pytestmark = pytest.mark.e2e

MAX_AGE_S = 120
INPUTS = {"input": np.ones((1, 256), np.float32)}
MOVE_TIMEOUT_S = 20.0
IDLE_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def h3_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path, h3_port: int
) -> Iterator[ServerProcess]:
    """HTTP/3 on a port of its own, so a client can only find it through alt-svc; idle
    connections end soon."""
    root = tmp_path_factory.mktemp("alt-svc")
    args = [
        *("--certs-dir", str(certs_dir), "--h3-port", str(h3_port)),
        *("--alt-svc-max-age", str(MAX_AGE_S), "--idle-timeout", str(IDLE_TIMEOUT_S)),
    ]
    with running_server(model_repository(root / "models", ["mlp"]), root / "log", args) as s:
        yield s


# grpc core shares a connection among the channels of a process unless told not to.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def alt_svc(metadata: object) -> list[str]:
    return [str(v) for k, v in metadata or () if k == HEADER]  # type: ignore[attr-defined]


async def test_each_http2_connection_is_told_of_http3_on_its_first_response(
    server: ServerProcess, h3_port: int
) -> None:
    """Unary, failed and streamed calls each carry it as a connection's first response; later
    responses on that connection do not (until the refresh: PerConnection)."""
    expected = [h3_header(h3_port, MAX_AGE_S)]
    async with grpc.aio.insecure_channel(server.address, OWN_CONNECTION) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelInfer(build_request("mlp", INPUTS), timeout=30)
        await call
        assert alt_svc(await call.initial_metadata()) == expected
        again = stub.ModelInfer(build_request("mlp", INPUTS), timeout=30)
        await again
        assert alt_svc(await again.initial_metadata()) == []
    async with grpc.aio.insecure_channel(server.address, OWN_CONNECTION) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        failed = stub.ModelInfer(build_request("no-such-model", INPUTS), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError):
            await failed
        assert alt_svc(await failed.initial_metadata()) == expected
    async with grpc.aio.insecure_channel(server.address, OWN_CONNECTION) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stream = stub.ModelStreamInfer(iter([build_request("mlp", INPUTS)]), timeout=30)
        assert [r.error_message async for r in stream] == [""]
        assert alt_svc(await stream.initial_metadata()) == expected


@pytest.fixture(scope="module")
def quiet_server(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    """HTTP/3 served, not advertised."""
    root = tmp_path_factory.mktemp("no-alt-svc")
    args = ["--alt-svc-max-age", "0", "--certs-dir", str(certs_dir)]
    with running_server(model_repository(root / "models", ["mlp"]), root / "log", args) as s:
        yield s


def test_no_alt_svc_when_turned_off(quiet_server: ServerProcess) -> None:
    call = quiet_server.stub.ServerReady.with_call(pb.ServerReadyRequest(), timeout=10)[1]
    assert alt_svc(call.initial_metadata()) == []


async def until_h3(client: AsyncInferenceClient) -> list[str]:
    """Calls until one went over HTTP/3 (bounded); the transport of each."""
    used: list[str] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + MOVE_TIMEOUT_S
    while not used or used[-1] != "h3":
        assert loop.time() < deadline, f"still on HTTP/2 after {len(used)} calls"
        await client.infer("mlp", INPUTS, timeout=10)
        used.append(client.transport)
        await asyncio.sleep(0.05)
    return used


async def test_auto_starts_on_http2_and_moves_to_the_advertised_http3(
    server: ServerProcess, certs_dir: Path
) -> None:
    policy = TransportPolicy()
    url = f"auto://localhost:{server.port}"
    ca = str(certs_dir / "ca.pem")
    async with AsyncInferenceClient(url, ca_file=ca, transport_policy=policy) as client:
        assert client.transport == "h2"
        await client.infer("mlp", INPUTS, timeout=10)
        assert (client.transport, client.connect_mode) == ("h2", "tcp")
        await until_h3(client)
        assert client.connect_mode == "full"
    # A new connection that knows HTTP/3 answers races it against HTTP/2; either answers.
    async with AsyncInferenceClient(url, ca_file=ca, transport_policy=policy) as client:
        await client.infer("mlp", INPUTS, timeout=10)
        assert client.transport in ("h2", "h3")
        await until_h3(client)


async def test_a_live_http3_connection_stays_a_new_one_is_decided_afresh(
    server: ServerProcess, certs_dir: Path
) -> None:
    policy = TransportPolicy()
    url = f"auto://localhost:{server.port}"
    async with AsyncInferenceClient(
        url, ca_file=str(certs_dir / "ca.pem"), transport_policy=policy
    ) as client:
        await until_h3(client)
        policy.learn("clear")  # as if the advertisement had expired
        await client.infer("mlp", INPUTS, timeout=10)
        assert client.transport == "h3"
        await asyncio.sleep(IDLE_TIMEOUT_S + 1)  # the connection idles out
        await client.infer("mlp", INPUTS, timeout=10)
        assert client.transport == "h2"


@pytest.fixture
async def black_hole() -> AsyncIterator[int]:
    """A UDP port where datagrams arrive and nothing answers, as behind a firewall."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


async def test_auto_falls_back_to_http2_within_a_second_and_remembers(
    quiet_server: ServerProcess, certs_dir: Path, black_hole: int
) -> None:
    """The server advertises nothing here, so what the policy was taught stays: HTTP/3 at a
    port that never answers."""
    policy = TransportPolicy()
    policy.learn(h3_header(black_hole, MAX_AGE_S))
    url = f"auto://localhost:{quiet_server.port}"
    async with AsyncInferenceClient(
        url, ca_file=str(certs_dir / "ca.pem"), transport_policy=policy
    ) as client:
        # The race: HTTP/3 never completes its handshake, HTTP/2 answers.
        await client.infer("mlp", INPUTS, timeout=1.0)
        assert client.transport == "h2"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MOVE_TIMEOUT_S
        while policy.blocked_until is None:  # until the handshake's timeout
            assert loop.time() < deadline, "the HTTP/3 failure was never recorded"
            await client.infer("mlp", INPUTS, timeout=1.0)
            assert client.transport == "h2"
            await asyncio.sleep(0.1)
        # Remembered: the next calls take HTTP/2 at once, without a new attempt.
        for _ in range(3):
            await client.infer("mlp", INPUTS, timeout=1.0)
            assert client.transport == "h2"
        assert policy.h3_endpoint("localhost") is None


def test_infer_reports_its_transport(server: ServerProcess, certs_dir: Path) -> None:
    result = subprocess.run(
        [
            *(sys.executable, "-m", "clients.cli", "infer", "mlp", "--random"),
            *("--url", f"auto://localhost:{server.port}", "--ca-file", str(certs_dir / "ca.pem")),
            *("--repeat", "2"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"^call 1: h2 tcp ", result.stdout, re.MULTILINE)
    assert re.search(r"^transport: h[23]$", result.stdout, re.MULTILINE)


def test_front_end_processes_advertise_too(tmp_path: Path, certs_dir: Path) -> None:
    h3_port = free_port()
    args = [
        *("--frontends", "2", "--certs-dir", str(certs_dir)),
        *("--h3-port", str(h3_port), "--alt-svc-max-age", "60"),
    ]
    with running_server(
        model_repository(tmp_path / "models", ["mlp"]), tmp_path / "log", args
    ) as s:
        with grpc.insecure_channel(s.address, OWN_CONNECTION) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            call = stub.ServerReady.with_call(pb.ServerReadyRequest(), timeout=10)[1]
        assert alt_svc(call.initial_metadata()) == [h3_header(h3_port, 60)]
