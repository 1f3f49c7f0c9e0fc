"""A plain HTTP request on an HTTP/3 stream (not gRPC: its content-type says so), served by an
ASGI application: the REST API on the server's own QUIC transport, beside gRPC on the same
connections. What aioquic's example server leaves out is here: the app hears
`http.disconnect` when the client resets the stream, stops reading it or loses the connection;
`send` waits while the peer has not taken what was sent (flow control); the scope carries
`asgi`; a request that arrived as 0-RTT early data runs before the handshake completes only if
its method is safe (GET, HEAD), so a replayed one changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol
from urllib.parse import unquote

from transport.asgi import App, Message, Scope, tls_extension
from transport.grpc.status import H3_NO_ERROR, H3_REQUEST_CANCELLED
from transport.h3.stream import H3Stream
from transport.h3.stream_state import Headers, StreamClosed
from transport.tls.peer_auth import PeerAuth

log = logging.getLogger("paddlequic.h3.server")

SAFE_METHODS = frozenset({"GET", "HEAD"})  # run from early data (RFC 8470: not replay-unsafe)
# Connection-specific fields HTTP/3 forbids (RFC 9114 4.2): an app's HTTP/1.1 habits.
_CONNECTION_FIELDS = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)
_DISCONNECT: Message = {"type": "http.disconnect"}


class PlainConnection(Protocol):
    """What a plain request uses of its connection (the server's `GrpcH3Protocol`)."""

    handshake_done: asyncio.Event
    terminated: StreamClosed | None

    def client(self) -> tuple[str, int] | None: ...

    def peer_auth(self) -> PeerAuth:
        """The client's certificate, if it authenticated with one."""

    def early_request_held(self) -> None:
        """Count a request held from early data until the handshake completes."""

    def stop_receiving(self, stream_id: int, error_code: int = ...) -> None: ...

    def reset(self, stream_id: int, error_code: int = ...) -> None: ...

    def forget(self, stream_id: int) -> None: ...


def request_scope(
    headers: Headers, client: tuple[str, int] | None, auth: PeerAuth | None = None
) -> Scope:
    """The ASGI scope of a request's header block (its pseudo-headers checked by aioquic), with
    ASGI's TLS extension: QUIC is always TLS 1.3, `auth` its client's certificate."""
    pseudo = {name: value for name, value in headers if name.startswith(b":")}
    fields = [(name, value) for name, value in headers if not name.startswith(b":")]
    authority = pseudo.get(b":authority")
    if authority is not None and not any(name == b"host" for name, _ in fields):
        fields.insert(0, (b"host", authority))
    raw_path, _, query = pseudo.get(b":path", b"/").partition(b"?")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "3",
        "method": pseudo.get(b":method", b"GET").decode("latin-1"),
        "scheme": pseudo.get(b":scheme", b"https").decode("latin-1"),
        "path": unquote(raw_path.decode("latin-1")),
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": fields,
        "client": client,
        "server": None,
        "extensions": {"tls": tls_extension(None if auth is None else auth.certificate, "TLSv1.3")},
    }


async def serve_plain_request(app: App, stream: H3Stream, connection: PlainConnection) -> None:
    """Run `app` on the request `stream` carries, up to the end of its answer."""
    assert stream.headers is not None  # the stream was opened by its header block
    scope = request_scope(stream.headers, connection.client(), connection.peer_auth())
    exchange = _Exchange(stream)
    cancelled = False
    try:
        if stream.early and scope["method"] not in SAFE_METHODS:
            connection.early_request_held()
            await connection.handshake_done.wait()  # a replayed handshake never completes
            if connection.terminated is not None:
                return
        await app(scope, exchange.receive, exchange.send)
    except asyncio.CancelledError:
        cancelled = True  # the server is stopping past its grace period
        raise
    except Exception:
        log.exception("plain HTTP request on stream %d failed", stream.stream_id)
    finally:
        exchange.finish(connection, 503 if cancelled else 500)
        if not stream.ended:
            # Nobody reads the rest of the body: after a complete answer that is no error.
            connection.stop_receiving(
                stream.stream_id, H3_NO_ERROR if stream.sent_end else H3_REQUEST_CANCELLED
            )
        connection.forget(stream.stream_id)


class _Exchange:
    """The app's `receive` and `send` on one stream."""

    def __init__(self, stream: H3Stream) -> None:
        self._stream = stream
        self._body_ended = False
        self._start: Message | None = None
        self._headers_sent = False

    async def receive(self) -> Message:
        stream = self._stream
        if not self._body_ended:
            try:
                chunk = await stream.read_message()
            except StreamClosed:
                return _DISCONNECT
            if chunk is None:
                self._body_ended = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return {"type": "http.request", "body": chunk, "more_body": True}
        await stream.wait_failed()
        return _DISCONNECT

    async def send(self, message: Message) -> None:
        """Nothing goes out once the client is gone (the app hears it from `receive`)."""
        stream = self._stream
        if stream.error is not None or stream.sent_end:
            return
        if message["type"] == "http.response.start":
            self._start = message
            return
        if message["type"] != "http.response.body" or self._start is None:
            return
        body = bytes(message.get("body", b""))
        more = bool(message.get("more_body", False))
        with contextlib.suppress(StreamClosed):
            if not self._headers_sent:
                self._headers_sent = True
                stream.send_headers(_response_headers(self._start), end=not body and not more)
                if not body and not more:
                    return
            await stream.send_data(body, end=not more)

    def finish(self, connection: PlainConnection, status: int) -> None:
        """The app returned: an answer it left unfinished ends here, as `status` if it sent
        nothing, or reset if it stopped in the middle of its body."""
        stream = self._stream
        if stream.sent_end or stream.error is not None:
            return
        with contextlib.suppress(StreamClosed):
            if not self._headers_sent:
                stream.send_headers([(b":status", str(status).encode())], end=True)
            else:
                connection.reset(stream.stream_id, H3_REQUEST_CANCELLED)


def _response_headers(start: Message) -> Headers:
    fields = [
        (bytes(name).lower(), bytes(value))
        for name, value in start.get("headers", ())
        if bytes(name).lower() not in _CONNECTION_FIELDS
    ]
    return [(b":status", str(int(start["status"])).encode()), *fields]
