"""Messages shaped to test HTTP/3 receive credit: sizes around its boundaries, and gRPC
calls whose request body goes out in DATA frames of chosen sizes.

QuicChannel sends each message as one DATA frame; libcurl/nghttp3 send a body in many, and
the first may end inside the 5-byte message prefix. The credit rule must let both complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from aioquic.quic.connection import QuicConnection
from hypothesis import strategies as st

from transport.grpc import headers as wire
from transport.h3.aioquic.credit import FRAMING_SLACK
from transport.h3.client import H3ClientConnection, _ClientProtocol, client_configuration
from transport.h3.settings import H3Settings

CALL_TIMEOUT_S = 60.0
STREAM_WINDOW = H3Settings().stream_window
CONNECTION_WINDOW = H3Settings().connection_window
# Where a message's fate changes: half a stream window (the credit batch), the stream window,
# one and a half (the batch past it), two; and the connection window. HTTP/3 moves a few
# MB/s on these machines, so sweeps of several messages leave the connection window out.
STREAM_BOUNDARIES = (STREAM_WINDOW // 2, STREAM_WINDOW, STREAM_WINDOW * 3 // 2, 2 * STREAM_WINDOW)
ALL_BOUNDARIES = (*STREAM_BOUNDARIES, CONNECTION_WINDOW)


def near(boundaries: tuple[int, ...]) -> st.SearchStrategy[int]:
    """Payload sizes just around a boundary: by the framing (bytes), by the slack, or inside
    the batch (up to half a window)."""
    delta = st.one_of(
        st.integers(-64, 64),
        st.integers(-2 * FRAMING_SLACK, 2 * FRAMING_SLACK),
        st.integers(-STREAM_WINDOW // 2, STREAM_WINDOW // 2),
    )
    return st.builds(lambda at, by: max(0, at + by), st.sampled_from(boundaries), delta)


def frames(body: bytes, head: int, chunk: int) -> Iterator[bytes]:
    """`body` cut into a first piece of `head` bytes, then pieces of `chunk` bytes."""
    yield body[:head]
    for start in itertools.count(head, chunk):
        if start >= len(body):
            return
        yield body[start : start + chunk]


@dataclass
class Answer:
    status: grpc.StatusCode
    message: str
    responses: list[bytes]
    frames_sent: int


async def framed_call(
    host: str, port: int, ca_file: str, path: str, body: bytes, head: int, chunk: int
) -> Answer:
    """One call on a connection of its own: the body (framed messages) as DATA frames of
    `head`, then `chunk` bytes, one `send_data` each; what the server answered."""
    configuration = client_configuration("localhost", ca_file)
    connection = await H3ClientConnection.connect(host, port, configuration)
    try:
        await connection.wait_connected()
        return await framed_call_on(connection, port, path, body, head, chunk)
    finally:
        await connection.close()


async def framed_call_on(
    connection: H3ClientConnection, port: int, path: str, body: bytes, head: int, chunk: int
) -> Answer:
    """`framed_call` on a connection that is already open."""
    stream = connection.open_stream()
    stream.send_headers(wire.request_headers(f"localhost:{port}", path, CALL_TIMEOUT_S))
    sent = 0
    for piece in frames(body, head, chunk):
        await stream.send_data(piece)
        sent += 1
    await stream.send_data(b"", end=True)
    head_block = await stream.wait_headers()
    responses: list[bytes] = []
    if not wire.is_trailers_only(head_block):
        while (message := await stream.read_message()) is not None:
            responses.append(message)
    status = wire.parse_trailers(stream.trailers or head_block)
    return Answer(status.code, status.message, responses, sent)


async def connect_from(source: str, port: int, ca_file: str) -> H3ClientConnection:
    """A connection to the server on 127.0.0.1:`port` from the loopback address `source`
    (127.0.0.2, ...: another client as far as per-address limits go), handshake done."""
    loop = asyncio.get_running_loop()
    quic = QuicConnection(configuration=client_configuration("localhost", ca_file))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((source, 0))
    transport, protocol = await loop.create_datagram_endpoint(
        lambda: _ClientProtocol(quic, settings=H3Settings()), sock=sock
    )
    assert isinstance(protocol, _ClientProtocol)
    stack = contextlib.AsyncExitStack()
    stack.callback(transport.close)
    stack.callback(protocol.close)
    protocol.connect(("127.0.0.1", port), transmit=True)
    protocol.ensure_h3()
    connection = H3ClientConnection(protocol, stack, resuming=False)
    await connection.wait_connected()
    return connection
