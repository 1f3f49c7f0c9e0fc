"""Access control against the real server on both transports: restricted protocols (header and
value, else UNAUTHENTICATED) and client certificates (mutual TLS) on HTTP/3 and HTTP/2 with TLS,
with the numpy client and the CLI."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from clients.inference_client import InferenceClient, build_request
from clients.quic_channel import QuicChannel
from clients.tickets import SessionTicketCache
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1 import control_pb2, control_pb2_grpc, testing_pb2, testing_pb2_grpc
from tests.reference import output_names
from tests.servers import (
    REPO_ROOT,
    ServerProcess,
    eventually,
    model_repository,
    refused_start,
    running_server,
)
from transport.tls.certs import issue_client_certificate

ADMIN = "admin-Secret-7f3a"
INFER = "infer-Secret-91c2"
ADMIN_HEADER = ("triton-grpc-protocol-admin-key", ADMIN)
INFER_HEADER = ("triton-grpc-protocol-infer-key", INFER)
REQUEST = build_request("mlp", {"input": np.ones((1, 256), np.float32)})
TIMEOUT_S = 30.0
PEER_AUTH = "/paddlequic.v1.Testing/PeerAuth"


@dataclass
class Restricted:
    server: ServerProcess
    certs: Path


@pytest.fixture(scope="module")
def restricted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Restricted]:
    root = tmp_path_factory.mktemp("restricted")
    certs = root / "certs"
    args = [
        "--certs-dir",
        str(certs),
        "--restricted-protocol",
        f"model-repository,control:admin-key={ADMIN}",
        "--restricted-protocol",
        f"inference:infer-key={INFER}",
    ]
    with running_server(model_repository(root / "models", ["mlp"]), root / "log", args) as s:
        yield Restricted(s, certs)


@asynccontextmanager
async def channel(restricted: Restricted, transport: str) -> AsyncIterator[Any]:
    address = f"localhost:{restricted.server.port}"
    if transport == "h3":
        async with QuicChannel(address, ca_file=str(restricted.certs / "ca.pem")) as h3:
            yield h3
    else:
        async with grpc.aio.insecure_channel(address) as h2:
            yield h2


async def _code(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.RpcError as exc:
        assert ADMIN not in str(exc.details()) and INFER not in str(exc.details())
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_restricted_categories_need_their_header(
    restricted: Restricted, transport: str
) -> None:
    async with channel(restricted, transport) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        control = control_pb2_grpc.ControlStub(ch)
        index = pb.RepositoryIndexRequest()
        unauthenticated = grpc.StatusCode.UNAUTHENTICATED
        assert await _code(stub.RepositoryIndex(index, timeout=TIMEOUT_S)) == unauthenticated
        wrong = [(ADMIN_HEADER[0], ADMIN + "x")]
        assert await _code(stub.RepositoryIndex(index, metadata=wrong)) == unauthenticated
        # One group's header does not open another group's categories.
        assert await _code(stub.RepositoryIndex(index, metadata=[INFER_HEADER])) == (
            unauthenticated
        )
        listing = control_pb2.ListInstancesRequest(model_name="mlp")
        assert await _code(control.ListInstances(listing)) == unauthenticated
        assert await _code(stub.ModelInfer(REQUEST, timeout=TIMEOUT_S)) == unauthenticated
        # Refused at its headers: the stream is read, never written, so no client write races
        # the server's status (grpc.aio then reports INTERNAL, grpc/grpc#36066).
        stream = stub.ModelStreamInfer(timeout=TIMEOUT_S)
        with pytest.raises(grpc.RpcError) as refused:
            await stream.read()
        assert refused.value.code() == unauthenticated
        assert "expecting header 'triton-grpc-protocol-infer-key'" in str(refused.value.details())

        models = await stub.RepositoryIndex(index, metadata=[ADMIN_HEADER])
        assert [m.name for m in models.models] == ["mlp"]
        instances = await control.ListInstances(listing, metadata=[ADMIN_HEADER])
        assert instances.instances
        response = await stub.ModelInfer(REQUEST, metadata=[INFER_HEADER], timeout=TIMEOUT_S)
        assert response.model_name == "mlp"
        streamed = stub.ModelStreamInfer(
            iter([REQUEST]), metadata=[INFER_HEADER], timeout=TIMEOUT_S
        )
        assert [r.error_message async for r in streamed] == [""]
        # Categories left unrestricted need nothing.
        metadata = await stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp"))
        assert metadata.name == "mlp"
        assert (await stub.ServerLive(pb.ServerLiveRequest())).live


def test_refusals_are_counted_and_secrets_never_logged(restricted: Restricted) -> None:
    with pytest.raises(grpc.RpcError):
        restricted.server.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=TIMEOUT_S)
    # The request log's line is written once the answer is on its way: it may follow it.
    eventually(lambda: "UNAUTHENTICATED" in restricted.server.log_text(), "the refusal logged")
    log = restricted.server.log_text()
    assert ADMIN not in log and INFER not in log
    assert "metrics on http://127.0.0.1:" in log  # --metrics-host defaults to loopback


def test_the_client_and_cli_send_headers(restricted: Restricted) -> None:
    url = f"h3://localhost:{restricted.server.port}"
    ca = str(restricted.certs / "ca.pem")
    with InferenceClient(url, ca_file=ca, metadata=[INFER_HEADER]) as client:
        outputs = client.infer("mlp", {"input": np.ones((1, 256), np.float32)})
    assert outputs[output_names("mlp")[0]].shape == (1, 10)
    refused = _cli("models", "--url", url, "--ca-file", ca)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    allowed = _cli("models", "--url", url, "--ca-file", ca, "--header", "=".join(ADMIN_HEADER))
    assert allowed.returncode == 0 and "READY" in allowed.stdout


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clients.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- mutual TLS ---------------------------------------------------------------------------------


@dataclass
class Mutual:
    server: ServerProcess
    ca: str
    cert: str
    key: str
    stranger_cert: str
    stranger_key: str


@pytest.fixture(scope="module")
def mutual(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mutual]:
    """HTTP/3 and HTTP/2 with TLS, both requiring a client certificate from the dev CA (an
    empty repository: the handshake is what is tested), with 0-RTT and Testing/PeerAuth
    allowed as early data."""
    root = tmp_path_factory.mktemp("mutual")
    certs = root / "certs"
    cert, key = issue_client_certificate(certs, "tester")
    stranger_cert, stranger_key = issue_client_certificate(root / "other", "stranger")
    ca = str(certs / "ca.pem")
    args = [
        "--certs-dir",
        str(certs),
        "--h2-tls",
        "--tls-client-ca",
        ca,
        "--require-client-cert",
        "--testing-service",
        "--early-data-methods",
        f"default,{PEER_AUTH}",
    ]
    (root / "models").mkdir()
    with running_server(root / "models", root / "log", args, wait=False) as server:
        deadline = time.monotonic() + 120
        while True:
            with (
                suppress(grpc.RpcError),
                InferenceClient(
                    f"grpcs://localhost:{server.port}",
                    ca,
                    client_cert=str(cert),
                    client_key=str(key),
                ) as client,
            ):
                if client.health() == "SERVING":
                    break
            assert server.process.poll() is None, server.log_text()
            assert time.monotonic() < deadline, server.log_text()
            time.sleep(0.2)
        yield Mutual(server, ca, str(cert), str(key), str(stranger_cert), str(stranger_key))


@pytest.mark.parametrize("scheme", ["grpcs", "h3"])
def test_a_client_certificate_is_required(mutual: Mutual, scheme: str) -> None:
    url = f"{scheme}://localhost:{mutual.server.port}"
    with InferenceClient(url, mutual.ca, client_cert=mutual.cert, client_key=mutual.key) as ok:
        assert ok.health() == "SERVING"
        assert ok.index() == []
    for cert, key in ((None, None), (mutual.stranger_cert, mutual.stranger_key)):
        refused = InferenceClient(url, mutual.ca, client_cert=cert, client_key=key)
        with refused, pytest.raises(grpc.RpcError) as failure:
            refused.health(timeout=10)
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE


async def _peer_auth_twice(
    mutual: Mutual, cache: SessionTicketCache, cert: str, key: str
) -> tuple[str | None, list[testing_pb2.PeerAuthResponse]]:
    """A new HTTP/3 connection: PeerAuth first (early data when resuming), then again on the
    same connection once the handshake completed."""
    async with QuicChannel(
        f"localhost:{mutual.server.port}",
        ca_file=mutual.ca,
        ticket_cache=cache,
        client_cert=cert,
        client_key=key,
        early_data_methods=frozenset({PEER_AUTH}),
    ) as ch:
        stub = testing_pb2_grpc.TestingStub(ch)
        first = await stub.PeerAuth(testing_pb2.EchoRequest(), timeout=TIMEOUT_S)
        assert ch._connection is not None
        await ch._connection.wait_connected()
        later = await stub.PeerAuth(testing_pb2.EchoRequest(), timeout=TIMEOUT_S)
    return ch.last_connect_mode, [first, later]


async def _handshake_stats(mutual: Mutual) -> dict[str, int]:
    async with QuicChannel(
        f"localhost:{mutual.server.port}",
        ca_file=mutual.ca,
        client_cert=mutual.cert,
        client_key=mutual.key,
    ) as ch:
        response = await control_pb2_grpc.ControlStub(ch).TransportStats(
            control_pb2.TransportStatsRequest(), timeout=TIMEOUT_S
        )
    return dict(response.h3_handshakes)


def _identity(response: testing_pb2.PeerAuthResponse) -> tuple[str, tuple[bytes, ...], bytes]:
    (pem,) = (p.values for p in response.properties if p.name == "x509_pem_cert")
    return response.identity_key, tuple(response.identities), b"".join(pem)


async def test_a_resumed_connection_keeps_its_client_certificate(mutual: Mutual) -> None:
    """With --require-client-cert, a second connection resumes with 0-RTT: the call in its
    early data and a later one are served, and the servicer sees the certificate of the full
    handshake, as grpcio shows it over HTTP/2; each client's ticket resumes its own identity,
    from one ticket cache."""
    other_cert, other_key = (
        str(p) for p in issue_client_certificate(Path(mutual.ca).parent, "tester-b")
    )
    before = await _handshake_stats(mutual)
    clients = [(mutual.cert, mutual.key), (other_cert, other_key)]
    cache = SessionTicketCache()  # one cache for both: it keeps tickets per certificate
    full = [await _peer_auth_twice(mutual, cache, *client) for client in clients]
    resumed = [await _peer_auth_twice(mutual, cache, *client) for client in clients]
    after = await _handshake_stats(mutual)

    assert [mode for mode, _ in full] == ["full", "full"]
    assert [mode for mode, _ in resumed] == ["0rtt-accepted", "0rtt-accepted"]
    assert after.get("0rtt_accepted", 0) - before.get("0rtt_accepted", 0) == 2
    # Served from early data: nothing was held for the handshake.
    assert after.get("early_requests_held", 0) == before.get("early_requests_held", 0)

    async with grpc.aio.secure_channel(
        f"localhost:{mutual.server.port}",
        grpc.ssl_channel_credentials(
            Path(mutual.ca).read_bytes(),
            Path(mutual.key).read_bytes(),
            Path(mutual.cert).read_bytes(),
        ),
    ) as h2:
        over_h2 = await testing_pb2_grpc.TestingStub(h2).PeerAuth(
            testing_pb2.EchoRequest(), timeout=TIMEOUT_S
        )
    for name, (_, full_calls), (_, resumed_calls) in zip(
        (b"tester", b"tester-b"), full, resumed, strict=True
    ):
        identities = {_identity(r)[:2] for r in [*full_calls, *resumed_calls]}
        assert identities == {("x509_common_name", (name,))}
    tester = [_identity(r) for r in [*full[0][1], *resumed[0][1], over_h2]]
    assert all(identity == tester[0] for identity in tester)
    assert tester[0][2] == Path(mutual.cert).read_bytes()
    reused = [
        {p.name: list(p.values) for p in r.properties}["ssl_session_reused"]
        for r in [*full[0][1], *resumed[0][1]]
    ]
    assert reused == [[b"false"], [b"false"], [b"true"], [b"true"]]

    # Still nobody gets in without a certificate.
    refused = InferenceClient(f"h3://localhost:{mutual.server.port}", mutual.ca)
    with refused, pytest.raises(grpc.RpcError) as failure:
        refused.health(timeout=10)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_cli_takes_a_client_certificate(mutual: Mutual) -> None:
    for scheme in ("grpcs", "h3"):
        url = f"{scheme}://localhost:{mutual.server.port}"
        refused = _cli("health", "--url", url, "--ca-file", mutual.ca)
        assert refused.returncode == 1, refused.stdout
        allowed = _cli(
            "health",
            "--url",
            url,
            "--ca-file",
            mutual.ca,
            "--client-cert",
            mutual.cert,
            "--client-key",
            mutual.key,
        )
        assert (allowed.returncode, allowed.stdout.strip()) == (0, "server: SERVING")


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--restricted-protocol", f"model-reposit:k={ADMIN}"], "unknown restricted protocol"),
        (
            ["--restricted-protocol", f"health:k={ADMIN}", "--restricted-protocol", "health:j=v"],
            "'health' can not be specified in multiple config groups",
        ),
        (["--require-client-cert"], "--require-client-cert needs --tls-client-ca"),
        (["--sequence-callers", "certified"], "--sequence-callers certified needs --tls-client-ca"),
        (["--tls-client-ca", "no-such-ca.pem"], "--tls-client-ca no-such-ca.pem: no PEM"),
        (["--tls-client-ca", "README.md"], "--tls-client-ca README.md: no PEM"),
        (
            ["--tls-client-ca", "CA", "--require-client-cert"],
            "--require-client-cert needs --h2-tls",
        ),
    ],
)
def test_unusable_security_settings_stop_the_server_at_start(
    tmp_path: Path, args: list[str], error: str
) -> None:
    ca = issue_client_certificate(tmp_path / "certs", "x")[0].with_name("ca.pem")
    args = [str(ca) if a == "CA" else a for a in args]
    refused = refused_start(["--model-repository", str(tmp_path), *args], timeout_s=60)
    assert error in refused
    assert ADMIN not in refused
