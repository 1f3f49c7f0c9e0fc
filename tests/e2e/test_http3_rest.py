"""REST over HTTP/3 on the server's own QUIC transport: the REST port's number over UDP (and
the gRPC HTTP/3 port: each stream is routed by its request), advertised by the TCP REST
port's `alt-svc`. Real clients in their own processes where one exists (libcurl with ngtcp2
through curl_cffi), the project's own HTTP/3 client where a test needs to reset a stream or
drop a connection; answers compared with TCP's and with in-process Paddle's."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from aioquic.tls import SessionTicket

from protos.inference import grpc_service_pb2 as pb
from tests.e2e.test_zero_rtt import stats
from tests.reference import call_inputs, run_reference
from tests.servers import (
    HTTP_PORT,
    REPO_ROOT,
    ServerProcess,
    model_repository,
    running_server,
)
from transport.grpc.framing import encode_message
from transport.grpc.headers import Status, parse_response_headers
from transport.h3.client import H3ClientConnection, client_configuration
from transport.h3.stream import H3Stream
from transport.h3.stream_state import Headers, StreamClosed

pytestmark = pytest.mark.e2e

MAX_INPUT = 1 << 20  # --http-max-input-size
BODY_TIMEOUT_S = 2.0  # --http-body-timeout
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Served:
    server: ServerProcess
    port: int  # REST, TCP and UDP
    ca_file: Path


def serve(root: Path, certs_dir: Path, extra: list[str]) -> Iterator[Served]:
    args = [
        *("--http-port", HTTP_PORT, "--certs-dir", str(certs_dir)),
        *("--http-max-input-size", str(MAX_INPUT), "--http-body-timeout", str(BODY_TIMEOUT_S)),
        *extra,
    ]
    repository = model_repository(root / "models", ["mlp", "generate"])
    with running_server(repository, root / "log", args) as server:
        yield Served(server, server.http_port, certs_dir / "ca.pem")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[Served]:
    yield from serve(tmp_path_factory.mktemp("http3_rest"), certs_dir, ["--http-tls"])


# A client in a process of its own: libcurl (ngtcp2, nghttp3) through curl_cffi. It prints
# each answer as [status, HTTP version, headers, body].
CURL = """
import json, sys
from curl_cffi import CurlHttpVersion, requests

ca_file, requests_json = sys.argv[1], sys.stdin.read()
versions = {"2": CurlHttpVersion.V2TLS, "3": CurlHttpVersion.V3ONLY}
answers = []
for url, version, body in json.loads(requests_json):
    if body is None:
        r = requests.get(url, http_version=versions[version], verify=ca_file, timeout=60)
    else:
        r = requests.post(url, http_version=versions[version], verify=ca_file, timeout=60,
                          data=body, headers={"content-type": "application/json"})
    answers.append([r.status_code, r.http_version, dict(r.headers), r.content.decode()])
print(json.dumps(answers))
"""
HTTP2, HTTP3 = 3, 30  # what curl reports of the version it spoke


def curl(served: Served, calls: list[tuple[str, str, str | None]]) -> list[Any]:
    """(url, "2" or "3", body or None) each, one curl process for them all."""
    done = subprocess.run(
        [sys.executable, "-c", CURL, str(served.ca_file)],
        input=json.dumps(calls),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr
    answers: list[Any] = json.loads(done.stdout)
    return answers


def infer_body(call: int) -> str:
    ((name, array),) = call_inputs("mlp", call).items()
    entry = {"name": name, "datatype": "FP32", "shape": list(array.shape), "data": array.tolist()}
    return json.dumps({"id": str(call), "inputs": [entry]})


def check_infer(answer: str, call: int) -> None:
    document = json.loads(answer)
    assert (document["model_name"], document["id"]) == ("mlp", str(call))
    expected = run_reference("mlp", call_inputs("mlp", call))
    assert {o["name"] for o in document["outputs"]} == set(expected)
    for output in document["outputs"]:
        values = np.array(output["data"], np.float32).reshape(output["shape"])
        np.testing.assert_allclose(values, expected[output["name"]], rtol=1e-5, atol=1e-6)


def test_curl_over_http3_answers_as_over_tcp_and_as_paddle(served: Served) -> None:
    """On the REST port's number and on the gRPC HTTP/3 port alike."""
    rest = f"https://localhost:{served.port}"
    grpc_h3 = f"https://localhost:{served.server.port}"
    calls: list[tuple[str, str, str | None]] = [
        (f"{rest}/v2/health/ready", "3", None),
        (f"{rest}/v2/models/mlp", "3", None),
        (f"{rest}/v2/models/mlp", "2", None),
        (f"{rest}/v2/models/nope/infer", "3", "{}"),
        (f"{rest}/v2/models/mlp/infer", "3", infer_body(0)),
        (f"{grpc_h3}/v2/models/mlp/infer", "3", infer_body(1)),
    ]
    ready, metadata3, metadata2, unknown, infer, infer_grpc_port = curl(served, calls)
    assert ready[:2] == [200, HTTP3] and json.loads(ready[3]) == {"ready": True}
    assert (metadata3[0], metadata3[1], metadata2[1]) == (200, HTTP3, HTTP2)
    assert json.loads(metadata3[3]) == json.loads(metadata2[3])
    assert unknown[:2] == [404, HTTP3] and "unknown model" in json.loads(unknown[3])["error"]
    assert infer[:2] == [200, HTTP3]
    check_infer(infer[3], 0)
    assert infer_grpc_port[:2] == [200, HTTP3]
    check_infer(infer_grpc_port[3], 1)


def test_tcp_rest_advertises_http3_on_its_port_number(served: Served) -> None:
    (answer,) = curl(served, [(f"https://localhost:{served.port}/v2/health/live", "2", None)])
    assert answer[2]["alt-svc"] == f'h3=":{served.port}"; ma=3600'


async def connect(served: Served, port: int | None = None) -> H3ClientConnection:
    configuration = client_configuration("localhost", str(served.ca_file))
    connection = await H3ClientConnection.connect("127.0.0.1", port or served.port, configuration)
    await connection.wait_connected()
    return connection


def request(stream: H3Stream, method: str, path: str, fields: Headers | None = None) -> None:
    head = [(b":method", method.encode()), (b":scheme", b"https"), (b":path", path.encode())]
    stream.send_headers([*head, (b":authority", b"localhost"), *(fields or [])])


async def answer(stream: H3Stream) -> tuple[int, bytes]:
    headers = await asyncio.wait_for(stream.wait_headers(), TIMEOUT_S)
    status = int(dict(headers)[b":status"])
    body = b""
    while (chunk := await asyncio.wait_for(stream.read_message(), TIMEOUT_S)) is not None:
        body += chunk
    return status, body


async def test_grpc_and_rest_calls_share_one_quic_connection(served: Served) -> None:
    connection = await connect(served)
    try:
        rest = connection.open_stream()
        request(rest, "GET", "/v2/models/mlp/ready")
        await rest.send_data(b"", end=True)
        grpc_call = connection.open_stream()
        request(
            grpc_call,
            "POST",
            "/inference.GRPCInferenceService/ModelReady",
            [(b"content-type", b"application/grpc"), (b"te", b"trailers")],
        )
        message = pb.ModelReadyRequest(name="mlp").SerializeToString()
        await grpc_call.send_data(encode_message(message), end=True)
        status, body = await answer(rest)
        assert (status, json.loads(body)) == (200, {"name": "mlp", "ready": True})
        status, reply = await answer(grpc_call)  # a gRPC answer's message, decoded
        assert status == 200
        assert grpc_call.trailers is not None and dict(grpc_call.trailers)[b"grpc-status"] == b"0"
        assert pb.ModelReadyResponse.FromString(reply).ready
    finally:
        await connection.close()


def generation_metric(served: Served, name: str) -> float:
    return sum(
        s.value
        for s in served.server.metrics()
        if s.name == name and s.labels.get("model") == "generate"
    )


async def leave_a_generation(served: Served, leaving: str, port: int | None = None) -> None:
    """Read the first event of a 250-token generation over HTTP/3, then reset its stream or
    drop the connection: the generation stops far short of 250 steps and frees its place."""
    steps = "paddlequic_inter_token_seconds_count"
    before = generation_metric(served, steps)
    connection = await connect(served, port)
    try:
        stream = connection.open_stream()
        request(
            stream,
            "POST",
            "/v2/models/generate/generate_stream",
            [(b"content-type", b"application/json")],
        )
        await stream.send_data(json.dumps({"text": "x", "max_tokens": 250}).encode(), end=True)
        headers = await asyncio.wait_for(stream.wait_headers(), TIMEOUT_S)
        assert dict(headers)[b":status"] == b"200"
        first = await asyncio.wait_for(stream.read_message(), TIMEOUT_S)
        assert first is not None and first.startswith(b"data: ")
        if leaving == "resets its stream":
            stream.cancel()
            await asyncio.sleep(0.1)  # the reset goes out while the connection lives on
    finally:
        await connection.close()
    deadline = time.monotonic() + 30
    while generation_metric(served, "paddlequic_active_generations") != 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    stopped = generation_metric(served, steps)
    await asyncio.sleep(0.5)
    assert generation_metric(served, steps) == stopped
    assert stopped - before < 150


@pytest.mark.parametrize("leaving", ["resets its stream", "closes its connection"])
async def test_a_client_that_leaves_stops_its_generation(served: Served, leaving: str) -> None:
    await leave_a_generation(served, leaving)


async def test_bodies_are_bounded_in_size_and_time(served: Served) -> None:
    connection = await connect(served)
    try:
        declared = connection.open_stream()
        length = str(MAX_INPUT + 1).encode()
        request(declared, "POST", "/v2/models/mlp/infer", [(b"content-length", length)])
        status, body = await answer(declared)
        assert status == 400 and b"refused before reading it" in body
        streamed = connection.open_stream()
        request(streamed, "POST", "/v2/models/mlp/infer")
        chunk = b" " * (64 << 10)
        for _ in range(MAX_INPUT // len(chunk) + 1):
            if streamed.headers is not None or streamed.send_error is not None:
                break  # answered: the server stopped reading
            try:
                await streamed.send_data(chunk)
            except StreamClosed:
                break  # the server's STOP_SENDING came while this waited for credit
        status, body = await answer(streamed)
        assert status == 400 and b"--http-max-input-size" in body
        stalled = connection.open_stream()
        request(stalled, "POST", "/v2/models/mlp/infer")
        await stalled.send_data(b'{"inputs": ')
        status, body = await answer(stalled)
        assert status == 408 and b"--http-body-timeout" in body
    finally:
        await connection.close()


async def early_request(
    served: Served, ticket: list[SessionTicket], method: str, path: str, body: bytes
) -> tuple[int, bytes]:
    """`method path` as the first request of a connection resumed with `ticket[0]`, sent
    before the handshake completes (0-RTT early data); the ticket the connection gets in
    turn replaces it."""
    configuration = client_configuration("localhost", str(served.ca_file), ticket.pop())
    connection = await H3ClientConnection.connect(
        "127.0.0.1", served.server.port, configuration, session_ticket_handler=ticket.append
    )
    try:
        stream = connection.open_stream()
        request(stream, method, path, [(b"content-type", b"application/json")])
        await stream.send_data(body, end=True)
        assert connection.sent_early
        handshake = await asyncio.wait_for(connection.wait_connected(), TIMEOUT_S)
        assert handshake.early_data_accepted
        answered = await answer(stream)
        await asyncio.wait_for(connection.ticket_received.wait(), TIMEOUT_S)
        return answered
    finally:
        await connection.close()


async def test_only_safe_methods_run_from_early_data(served: Served) -> None:
    """A GET sent as 0-RTT early data runs at once; a POST (it could be replayed) waits for
    the handshake, then runs once. On the gRPC HTTP/3 port, whose counters /metrics and the
    Control service show."""
    tickets: list[SessionTicket] = []
    configuration = client_configuration("localhost", str(served.ca_file))
    first = await H3ClientConnection.connect(
        "127.0.0.1", served.server.port, configuration, session_ticket_handler=tickets.append
    )
    await asyncio.wait_for(first.ticket_received.wait(), TIMEOUT_S)
    await first.close()

    def held() -> int:
        return int(stats(served.server).h3_handshakes["early_requests_held"])

    before = held()
    status, body = await early_request(served, tickets, "GET", "/v2/health/ready", b"")
    assert (status, json.loads(body)) == (200, {"ready": True})
    assert held() == before
    status, body = await early_request(
        served, tickets, "POST", "/v2/models/mlp/infer", infer_body(2).encode()
    )
    assert status == 200
    check_infer(body.decode(), 2)
    assert held() == before + 1


async def test_the_rest_ports_http3_connections_are_counted(served: Served) -> None:
    """TransportStats and /metrics count HTTP/3 on the REST port's number with the gRPC
    port's."""
    before = stats(served.server).h3_connections
    connection = await connect(served)
    await connection.close()
    assert stats(served.server).h3_connections == before + 1


async def test_a_header_block_over_the_limit_is_refused_431(served: Served) -> None:
    """The server drops a block over its SETTINGS_MAX_FIELD_SECTION_SIZE unread: the answer
    says 431 to a REST client and RESOURCE_EXHAUSTED to a gRPC one, in one header block."""
    connection = await connect(served)
    try:
        stream = connection.open_stream()
        bomb = [(b"x-bomb-%d" % i, b"b" * 4096) for i in range(8)]  # --max-metadata-bytes 16 KiB
        request(stream, "GET", "/v2/health/ready", bomb)
        await stream.send_data(b"", end=True)
        answered = await asyncio.wait_for(stream.wait_headers(), TIMEOUT_S)
        block = dict(answered)
        assert (block[b":status"], block[b"grpc-status"]) == (b"431", b"8")
        assert b"SETTINGS_MAX_FIELD_SECTION_SIZE" in block[b"grpc-message"]
        status = parse_response_headers(answered)  # as the gRPC clients of transport/ read it
        assert isinstance(status, Status) and status.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await connection.close()
