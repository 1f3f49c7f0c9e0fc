"""A second HTTP/3 stack against the server: libcurl with ngtcp2 and nghttp3 (curl_cffi).

Every other HTTP/3 client of the suite is aioquic, which frames and schedules the same way
on both ends; libcurl sends a request body in many DATA frames, as its read callback hands
it over, reads trailers its own way, and fails a transfer whose upload is stopped with any
code but H3_NO_ERROR (`curl: (95) HTTP/3 stream 0 reset by server`), status or not. gRPC
is spoken by hand: POST, the gRPC headers, length-prefixed messages, grpc-status from the
trailers (curl_cffi lists trailers with the response headers).
"""

from __future__ import annotations

import asyncio
import gzip
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from curl_cffi import CurlHttpVersion, CurlOpt, requests
from curl_cffi.requests import AsyncSession
from hypothesis import example, given, settings
from hypothesis import strategies as st

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as inference_pb
from protos.inference import grpc_service_pb2_grpc as inference_grpc
from protos.paddlequic.v1 import testing_pb2 as pb
from tests.conformance.conftest import H2_OPTIONS, transport_stats
from tests.framed_h3 import ALL_BOUNDARIES, CONNECTION_WINDOW, STREAM_WINDOW, frames, near
from tests.reference import assert_matches_reference, call_inputs
from tests.servers import ServerProcess
from transport.grpc.framing import MessageDecoder, encode_message

CALL_TIMEOUT_S = 60.0
INFERENCE = "/inference.GRPCInferenceService"
TESTING = "/paddlequic.v1.Testing"
HTTP3 = 30  # what curl reports for a response that came over HTTP/3


@dataclass
class Answer:
    status: grpc.StatusCode
    message: str
    messages: list[bytes]
    headers: Mapping[str, str]  # headers and trailers


def curl_call(
    server: ServerProcess,
    ca_file: Path,
    path: str,
    body: bytes | Iterator[bytes],
    headers: Mapping[str, str] | None = None,
) -> Answer:
    """One gRPC call over HTTP/3 only; an iterator body goes out as a streamed upload."""
    response = requests.post(
        f"https://localhost:{server.port}{path}",
        headers={"content-type": "application/grpc", "te": "trailers", **(headers or {})},
        http_version=CurlHttpVersion.V3ONLY,
        verify=str(ca_file),  # type: ignore[arg-type]  # a CA file, as curl_cffi accepts
        timeout=CALL_TIMEOUT_S,
        content=body,
    )
    assert (response.status_code, response.http_version) == (200, HTTP3)
    assert response.headers.get("content-type") == "application/grpc"
    messages = MessageDecoder().feed(response.content)
    code = int(response.headers.get("grpc-status", "-1"))
    status = next(s for s in grpc.StatusCode if s.value[0] == code)
    answer_headers = {name.lower(): value or "" for name, value in response.headers.items()}
    return Answer(status, response.headers.get("grpc-message", ""), messages, answer_headers)


def test_server_live(conformance_server: ServerProcess, ca_file: Path) -> None:
    body = encode_message(inference_pb.ServerLiveRequest().SerializeToString())
    answer = curl_call(conformance_server, ca_file, f"{INFERENCE}/ServerLive", body)
    assert answer.status is grpc.StatusCode.OK
    [live] = [inference_pb.ServerLiveResponse.FromString(m) for m in answer.messages]
    assert live.live


def test_model_infer_answers_as_over_http2(
    conformance_server: ServerProcess, ca_file: Path
) -> None:
    inputs = call_inputs("mlp", 0)
    request = build_request("mlp", inputs)
    body = encode_message(request.SerializeToString())
    answer = curl_call(conformance_server, ca_file, f"{INFERENCE}/ModelInfer", body)
    assert answer.status is grpc.StatusCode.OK
    [response] = [inference_pb.ModelInferResponse.FromString(m) for m in answer.messages]
    assert_matches_reference("mlp", inputs, response)
    with grpc.insecure_channel(conformance_server.address, options=H2_OPTIONS) as channel:
        expected = inference_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=CALL_TIMEOUT_S
        )
    assert response.raw_output_contents == expected.raw_output_contents
    assert [o.shape for o in response.outputs] == [o.shape for o in expected.outputs]


def test_an_error_status_arrives_in_trailers(
    conformance_server: ServerProcess, ca_file: Path
) -> None:
    request = build_request("no_such_model", {"input": np.zeros((1, 256), np.float32)})
    body = encode_message(request.SerializeToString())
    answer = curl_call(conformance_server, ca_file, f"{INFERENCE}/ModelInfer", body)
    assert answer.status is grpc.StatusCode.NOT_FOUND and answer.messages == []
    assert "no_such_model" in answer.message


@settings(max_examples=6, deadline=None, derandomize=True, database=None)
@given(size=near(ALL_BOUNDARIES), head=st.integers(1, 9), chunk=st.sampled_from([4096, 65536]))
@example(size=int(1.2 * (1 << 20)), head=5, chunk=65536)
@example(size=2 << 20, head=5, chunk=65536)
def test_unary_echo_of_any_size_in_a_streamed_body(
    conformance_server: ServerProcess, ca_file: Path, size: int, head: int, chunk: int
) -> None:
    """The body handed to libcurl piece by piece, the first piece inside the prefix."""
    sent = os.urandom(size)
    body = encode_message(pb.EchoRequest(payload=sent).SerializeToString())
    answer = curl_call(conformance_server, ca_file, f"{TESTING}/Unary", frames(body, head, chunk))
    assert (answer.status, answer.message) == (grpc.StatusCode.OK, "")
    assert [pb.EchoResponse.FromString(m).payload for m in answer.messages] == [sent]


def test_bidi_stream_of_large_messages(conformance_server: ServerProcess, ca_file: Path) -> None:
    """Several messages either side of the stream window, streamed both ways."""
    sent = [os.urandom(size) for size in (300_000, 900_000, 1_300_000, 2 << 20)]

    def body() -> Iterator[bytes]:
        for message in sent:
            yield encode_message(pb.EchoRequest(payload=message).SerializeToString())

    answer = curl_call(conformance_server, ca_file, f"{TESTING}/BidiStream", body())
    assert (answer.status, answer.message) == (grpc.StatusCode.OK, "")
    assert [pb.EchoResponse.FromString(m).payload for m in answer.messages] == sent


async def test_concurrent_uploads_on_one_connection(
    conformance_server: ServerProcess, ca_file: Path
) -> None:
    """20 calls of 0.9 MiB at once on one libcurl connection (PIPEWAIT: wait to multiplex
    rather than open more), together past the connection window."""
    calls, size = 20, STREAM_WINDOW * 9 // 10
    assert calls * size > CONNECTION_WINDOW + size
    body = encode_message(pb.EchoRequest(payload=os.urandom(size)).SerializeToString())
    before = await transport_stats(conformance_server)
    async with AsyncSession(curl_options={CurlOpt.PIPEWAIT: 1}) as session:

        async def upload() -> tuple[str | None, pb.EchoResponse]:
            response = await session.post(
                f"https://localhost:{conformance_server.port}{TESTING}/ClientStream",
                headers={"content-type": "application/grpc", "te": "trailers"},
                http_version=CurlHttpVersion.V3ONLY,
                verify=str(ca_file),
                timeout=CALL_TIMEOUT_S,
                content=body,
            )
            [message] = MessageDecoder().feed(response.content)
            return response.headers.get("grpc-status"), pb.EchoResponse.FromString(message)

        answers = await asyncio.gather(*(upload() for _ in range(calls)))
    after = await transport_stats(conformance_server)
    assert [(s, r.messages, r.total_bytes) for s, r in answers] == [("0", 1, size)] * calls
    assert after.h3_connections == before.h3_connections + 1


@pytest.mark.parametrize(
    ("path", "headers"),
    [("/no.such.Service/Method", {}), (f"{TESTING}/Unary", {"grpc-encoding": "snappy"})],
    ids=["unknown-method", "refused-encoding"],
)
def test_an_answer_before_the_upload_ended_reaches_libcurl(
    conformance_server: ServerProcess, ca_file: Path, path: str, headers: dict[str, str]
) -> None:
    """4 MiB announced and sent, more than the stream window: the answer comes first, and the
    upload is stopped with H3_NO_ERROR (on 58663b5 libcurl failed every such call)."""
    size = 4 << 20
    body = struct.pack(">BI", 0, size) + bytes(size)
    for _ in range(3):
        answer = curl_call(conformance_server, ca_file, path, body, headers)
        assert answer.status is grpc.StatusCode.UNIMPLEMENTED
        assert answer.headers["grpc-accept-encoding"] == "identity,deflate,gzip"


def test_libcurl_sends_a_gzip_message(conformance_server: ServerProcess, ca_file: Path) -> None:
    payload = b"squeeze me " * 1000
    compressed = gzip.compress(pb.EchoRequest(payload=payload).SerializeToString())
    body = struct.pack(">BI", 1, len(compressed)) + compressed
    answer = curl_call(
        conformance_server, ca_file, f"{TESTING}/Unary", body, {"grpc-encoding": "gzip"}
    )
    assert answer.status is grpc.StatusCode.OK
    assert [pb.EchoResponse.FromString(m).payload for m in answer.messages] == [payload]
