"""How an HTTP/3 stream is routed by its request (gRPC, or plain HTTP for the REST app), what a
plain request's body looks like to the app (its DATA as it came, bytes held counted for
credit), and the ASGI scope its header block becomes."""

from __future__ import annotations

import pytest

from transport.grpc.framing import encode_message
from transport.grpc.headers import carries_grpc
from transport.h3.asgi import request_scope
from transport.h3.stream_state import StreamState

REQUEST = [(b":method", b"POST"), (b":scheme", b"https"), (b":path", b"/x")]


@pytest.mark.parametrize(
    ("headers", "grpc"),
    [
        ([*REQUEST, (b"content-type", b"application/grpc")], True),
        ([*REQUEST, (b"content-type", b"application/grpc+proto")], True),
        ([*REQUEST, (b"content-type", b"application/json")], False),
        ([*REQUEST, (b"content-type", b"application/grpc-web")], False),
        (REQUEST, False),  # a request without a content-type: plain (curl, httpx)
        ([(b":status", b"200"), (b"content-type", b"application/grpc")], True),
        ([(b":status", b"415")], True),  # an HTTP-level refusal of a gRPC call
        ([(b":status", b"200"), (b"content-type", b"text/event-stream")], False),
    ],
)
def test_a_header_block_is_grpc_by_its_content_type(
    headers: list[tuple[bytes, bytes]], grpc: bool
) -> None:
    assert carries_grpc(headers) is grpc


def test_a_plain_body_is_its_data_as_it_came() -> None:
    state = StreamState(max_message=4)  # a gRPC message limit does not bound a plain body
    state.headers_received([*REQUEST, (b"content-type", b"application/json")], ended=False)
    assert state.data_received(b'{"inputs": ', ended=False)
    assert state.data_received(encode_message(b"not a frame"), ended=True)
    assert state.error is None and state.ended and state.plain
    assert state.held == 11 + 16
    assert state.take_message() == b'{"inputs": '
    assert state.take_message() == encode_message(b"not a frame")
    assert state.take_message() is None and state.held == 0


def test_a_grpc_body_is_still_decoded() -> None:
    state = StreamState(max_message=1 << 20)
    state.headers_received([*REQUEST, (b"content-type", b"application/grpc")], ended=False)
    state.data_received(encode_message(b"a"), ended=True)
    assert not state.plain and state.take_message() == b"a"


def test_the_scope_of_a_request() -> None:
    headers = [
        (b":method", b"GET"),
        (b":scheme", b"https"),
        (b":authority", b"localhost:8000"),
        (b":path", b"/v2/models/a%20b/ready?x=1"),
        (b"accept", b"*/*"),
    ]
    scope = request_scope(headers, ("127.0.0.1", 5000))
    assert scope["asgi"]["version"] == "3.0" and scope["http_version"] == "3"
    assert (scope["method"], scope["scheme"]) == ("GET", "https")
    assert scope["path"] == "/v2/models/a b/ready"
    assert (scope["raw_path"], scope["query_string"]) == (b"/v2/models/a%20b/ready", b"x=1")
    assert scope["headers"] == [(b"host", b"localhost:8000"), (b"accept", b"*/*")]
    assert scope["client"] == ("127.0.0.1", 5000)
