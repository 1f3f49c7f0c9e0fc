"""The REST listener: hypercorn's HTTP/1.1 (h11) and HTTP/2 (h2: cleartext by prior knowledge
or h2c upgrade, or over TLS by ALPN) over TCP, embedded in this process's event loop.

hypercorn is the one Python server that embeds in a running asyncio loop and speaks HTTP/2
(uvicorn has no HTTP/2, granian runs its own worker processes): docs/architecture.md gives
the measurement. The bounds it enforces itself are set here: header block size, the idle
time of a connection without a request in progress (which bounds a slow first request's
headers too), and the streams one HTTP/2 connection runs at once; the connections held at
once are bounded by the listening socket (held_connections.py).

Connections are accepted here rather than by hypercorn's `worker_serve`, each handed to its
`TCPServer` as `worker_serve` does, for three things it lacks: the TLS context trusts only
--tls-client-ca for client certificates (hypercorn's would trust the system's roots too), a
connection closed while its client is still sending lingers first (lingering.py), and
each TLS connection's app is told its client's certificate (ASGI's TLS extension), so a REST
caller is known by its certificate as a gRPC caller is."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from cryptography import x509
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config
from hypercorn.utils import wrap_app

from service.http.asgi import App, Message, Receive, Scope, Send
from service.http.bounds import SEND_PIECE
from service.http.held_connections import HeldConnections
from service.http.lingering import LINGER_S, LingeringWriter
from transport.asgi import tls_extension
from transport.h3.aioquic.client_auth import ClientAuth

log = logging.getLogger("paddlequic.http")

MAX_STREAMS_PER_CONNECTION = 100  # HTTP/2 requests one connection runs at once
# hypercorn's own TLS settings (its Config.create_ssl_context), kept.
_CIPHERS = "ECDHE+AESGCM"
_ALPN = ["h2", "http/1.1"]


@dataclass(frozen=True)
class HttpOptions:
    host: str
    port: int
    max_header_bytes: int  # a request's header block (--max-metadata-bytes)
    keepalive_timeout_s: float  # a connection without a request in progress
    max_connections: int  # held at once by this process, TLS handshakes included
    tls: tuple[Path, Path] | None = None  # certificate chain and key (None: clear text)
    reuse_port: bool = False  # share the port with other processes (SO_REUSEPORT: front-ends)
    # What every response adds (such as `alt-svc`, where HTTP/3 answers).
    response_headers: tuple[tuple[bytes, bytes], ...] = ()
    # Client certificates over TLS (--tls-client-ca, --require-client-cert; None: not asked).
    client_auth: ClientAuth | None = None
    # How long a client may take none of a response being sent (--http-send-timeout).
    send_timeout_s: float = 30.0


class HttpListener:
    def __init__(self, served: asyncio.Task[None], stop: asyncio.Event, port: int) -> None:
        self._served = served
        self._stop = stop
        self.port = port

    async def stop(self, grace: float) -> None:
        """Stops accepting, lets requests in flight finish for up to `grace` seconds."""
        self._stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._served


async def start_http(app: App, options: HttpOptions, grace: float) -> HttpListener:
    """Listening once it returns (a port in use raises here, at start)."""
    config = Config()
    config.bind = [
        f"[{options.host}]:{options.port}"
        if ":" in options.host
        else f"{options.host}:{options.port}"
    ]
    config.h11_max_incomplete_size = options.max_header_bytes
    config.h2_max_header_list_size = options.max_header_bytes
    config.h2_max_concurrent_streams = MAX_STREAMS_PER_CONNECTION
    config.keep_alive_timeout = options.keepalive_timeout_s
    config.include_server_header = False
    config.errorlog = log
    config.accesslog = None
    if options.reuse_port:
        listening = reuse_port_socket(options.host, options.port)
    else:
        (listening,) = config.create_sockets().insecure_sockets  # no certfile: bound as is
    listening = HeldConnections.listening(listening, options.max_connections)
    port = int(listening.getsockname()[1])
    if options.response_headers:
        app = _with_headers(app, options.response_headers)
    app = _draining(app)
    context = None if options.tls is None else tls_context(options.tls, options.client_auth)
    connections = _Connections(app, config, options.send_timeout_s)
    try:
        server = await asyncio.start_server(
            connections.serve,
            backlog=config.backlog,
            ssl=context,
            sock=listening,
            # A TLS handshake is a connection with no request in progress (hypercorn's 60 s
            # held a silent peer's place among --http-max-connections twelve times as long).
            ssl_handshake_timeout=options.keepalive_timeout_s if context else None,
        )
    except BaseException:
        listening.close()
        raise
    stop = asyncio.Event()
    served = asyncio.create_task(_serve(server, connections, stop, grace))
    log.info(
        "listening: KServe v2 REST over HTTP/1.1 and HTTP/2 (%s) on %s:%d",
        _describe(options),
        options.host,
        port,
    )
    return HttpListener(served, stop, port)


def tls_context(files: tuple[Path, Path], client_auth: ClientAuth | None) -> ssl.SSLContext:
    """hypercorn's TLS settings (TLS 1.2 or later, no compression, ALPN h2 then HTTP/1.1), and
    client certificates verified against `client_auth`'s CA alone: asked for (CERT_OPTIONAL: one
    that is sent must verify) or required (CERT_REQUIRED: the handshake fails without one).
    OpenSSL checks that a client's certificate is for client authentication."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.set_ciphers(_CIPHERS)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # RFC 7540 9.2
    context.options |= ssl.OP_NO_COMPRESSION  # RFC 7540 9.2.1
    context.set_alpn_protocols(_ALPN)
    context.load_cert_chain(certfile=str(files[0]), keyfile=str(files[1]))
    if client_auth is not None:
        context.load_verify_locations(cafile=str(client_auth.ca_file))
        context.verify_mode = ssl.CERT_REQUIRED if client_auth.required else ssl.CERT_OPTIONAL
    return context


class _Connections:
    """Each accepted connection run by hypercorn's `TCPServer`, as `worker_serve` runs them, a
    TLS connection's app told its client's certificate."""

    def __init__(self, app: App, config: Config, send_timeout_s: float) -> None:
        self.app = app
        self.config = config
        self.send_timeout_s = send_timeout_s
        self.context = WorkerContext(None)  # no bound on requests per process
        self.tasks: set[asyncio.Task[Any]] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        secured: ssl.SSLObject | None = writer.get_extra_info("ssl_object")
        app = self.app if secured is None else _with_tls(self.app, secured)
        app = sending_within(app, self.send_timeout_s, lambda: reset(writer.transport))
        # Our apps type their messages as plain dicts, hypercorn as TypedDicts: the same shapes.
        wrapped = wrap_app(cast(Any, app), 0, "asgi")
        loop = asyncio.get_running_loop()
        lingering = LingeringWriter(reader, writer)
        # LingeringWriter has what TCPServer uses of a StreamWriter.
        closing = cast(asyncio.StreamWriter, lingering)
        try:
            await TCPServer(wrapped, loop, self.config, self.context, {}, reader, closing)
            await lingering.lingered()
        finally:
            lingering.end()

    async def finish(self, grace: float) -> None:
        """Tells every connection to finish (an idle one closes now), waits up to `grace`
        seconds for them, then cancels those left."""
        await self.context.terminated.set()
        if not self.tasks:
            return
        _, late = await asyncio.wait(set(self.tasks), timeout=grace)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)


async def _serve(
    server: asyncio.Server, connections: _Connections, stop: asyncio.Event, grace: float
) -> None:
    try:
        await stop.wait()
    finally:
        server.close()  # accepts no more
        await connections.finish(grace)
        await server.wait_closed()


def _with_tls(app: App, secured: ssl.SSLObject) -> App:
    """`app`, each request's scope carrying its connection's TLS extension."""
    der = secured.getpeercert(binary_form=True)
    certificate = None if der is None else x509.load_der_x509_certificate(der)
    tls = tls_extension(certificate, secured.version() or "")

    async def told(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("extensions", {})["tls"] = tls
        await app(scope, receive, send)

    return told


def _describe(options: HttpOptions) -> str:
    if options.tls is None:
        return "h2c"
    if options.client_auth is None:
        return "TLS, ALPN"
    required = "required" if options.client_auth.required else "optional"
    return f"TLS, ALPN, client certificates {required}"


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound with SO_REUSEPORT, as hypercorn binds its own (no delay, not
    blocking): the kernel spreads new connections over every process listening on the port."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _draining(app: App) -> App:
    """`app`, with what hypercorn still queues for a request whose app ended before its body
    did taken off the queue until the stream's end: hypercorn (0.18) puts that end
    (`http.disconnect`) on the app's queue of ten messages once the app has ended, and waits
    while the queue is full of body the app left unread, which holds the connection open,
    neither read nor closed (a front-end passing a body on to the parent stops reading it once
    the parent refuses it). Bounded by LINGER_S per request, as the lingering close is."""

    async def drained(scope: Scope, receive: Receive, send: Send) -> None:
        ended = False

        async def watched() -> Message:
            nonlocal ended
            message = await receive()
            ended = message["type"] == "http.disconnect" or not message.get("more_body", False)
            return message

        try:
            await app(scope, receive if scope["type"] != "http" else watched, send)
        finally:
            if scope["type"] == "http" and not ended:
                _DRAINS.add(task := asyncio.get_running_loop().create_task(_drain(receive)))
                task.add_done_callback(_DRAINS.discard)

    return drained


_DRAINS: set[asyncio.Task[None]] = set()  # referenced while they run


async def _drain(receive: Receive) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while (await receive())["type"] != "http.disconnect":
                pass


def reset(transport: asyncio.WriteTransport) -> None:
    """Closes the connection with a reset, dropping what its socket still holds to send: a
    plain close (asyncio's `abort` too) leaves the kernel sending the socket's buffer (4 MB
    each, measured) to a client that reads none of it, the connection in FIN-WAIT-1 meanwhile.
    nginx resets a connection that timed out the same way (reset_timedout_connection)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class SendStalled(Exception):
    """The client took none of a response piece within --http-send-timeout."""


def sending_within(app: App, timeout_s: float, abort: Callable[[], None]) -> App:
    """`app`, each piece of a response body (SEND_PIECE bytes at most) to be taken by the
    client within `timeout_s`, else the connection is aborted (`abort`): as nginx's
    send_timeout, the time between two pieces, not for all of it, so a slow reader gets a
    large answer and one that reads nothing holds the answer (and its connection) that long,
    no longer. A client that stops reading stalls hypercorn's send (HTTP/1.1: the socket's
    buffer full; HTTP/2: the stream's window shut) with the whole answer held: 32 connections
    that never read an answer of 11 MB held 624 MB for good, and a slow or lost client
    looks the same."""

    async def bounded(scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            body = message.get("body", b"")
            more = message.get("more_body", False)
            for start in range(0, max(len(body), 1), SEND_PIECE):
                # Each piece a copy, made as it goes: one at a time besides the body.
                piece = body if len(body) <= SEND_PIECE else body[start : start + SEND_PIECE]
                last = start + SEND_PIECE >= len(body)
                try:
                    async with asyncio.timeout(timeout_s):
                        await send(
                            {
                                "type": "http.response.body",
                                "body": piece,
                                "more_body": more or not last,
                            }
                        )
                except TimeoutError:
                    abort()
                    raise SendStalled from None

        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        with contextlib.suppress(SendStalled):
            await app(scope, receive, sending)

    return bounded


def _with_headers(app: App, headers: tuple[tuple[bytes, bytes], ...]) -> App:
    """`app`, each of its responses carrying `headers` too."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def adding(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *headers]}
            await send(message)

        await app(scope, receive, adding)

    return wrapped
