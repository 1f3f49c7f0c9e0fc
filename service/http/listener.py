"""The REST listener: hypercorn's asyncio server, embedded in this process's event loop, on
HTTP/1.1 (h11) and HTTP/2 (h2: cleartext by prior knowledge or h2c upgrade, or over TLS by
ALPN) over TCP.

hypercorn is the one Python server that embeds in a running asyncio loop and speaks HTTP/2
(uvicorn has no HTTP/2, granian runs its own worker processes): docs/architecture.md gives
the measurement. The bounds it enforces itself are set here: header block size, the idle
time of a connection without a request in progress (which bounds a slow first request's
headers too), and the streams one HTTP/2 connection runs at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from hypercorn.asyncio.run import worker_serve
from hypercorn.config import Config, Sockets
from hypercorn.utils import wrap_app

from service.http.asgi import App, Message, Receive, Scope, Send

log = logging.getLogger("paddlequic.http")

MAX_STREAMS_PER_CONNECTION = 100  # HTTP/2 requests one connection runs at once


@dataclass(frozen=True)
class HttpOptions:
    host: str
    port: int
    max_header_bytes: int  # a request's header block (--max-metadata-bytes)
    keepalive_timeout_s: float  # a connection without a request in progress
    tls: tuple[Path, Path] | None = None  # certificate chain and key (None: clear text)
    reuse_port: bool = False  # share the port with other processes (SO_REUSEPORT: front-ends)
    # What every response adds (such as `alt-svc`, where HTTP/3 answers).
    response_headers: tuple[tuple[bytes, bytes], ...] = ()


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
    config.graceful_timeout = grace
    if options.tls is not None:
        config.certfile, config.keyfile = (str(p) for p in options.tls)
    config.include_server_header = False
    config.errorlog = log
    config.accesslog = None
    if options.reuse_port:
        listening = reuse_port_socket(options.host, options.port)
        tls = options.tls is not None
        sockets = Sockets([listening] if tls else [], [] if tls else [listening], [])
    else:
        sockets = config.create_sockets()
        (listening,) = sockets.secure_sockets or sockets.insecure_sockets
    port = int(listening.getsockname()[1])
    if options.response_headers:
        app = _with_headers(app, options.response_headers)
    stop = asyncio.Event()
    served = asyncio.create_task(
        # Our apps type their messages as plain dicts, hypercorn as TypedDicts: the same shapes.
        worker_serve(
            wrap_app(cast(Any, app), 0, "asgi"), config, sockets=sockets, shutdown_trigger=stop.wait
        )
    )
    log.info(
        "listening: KServe v2 REST over HTTP/1.1 and HTTP/2 (%s) on %s:%d",
        "TLS, ALPN" if options.tls else "h2c",
        options.host,
        port,
    )
    return HttpListener(served, stop, port)


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


def _with_headers(app: App, headers: tuple[tuple[bytes, bytes], ...]) -> App:
    """`app`, each of its responses carrying `headers` too."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def adding(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *headers]}
            await send(message)

        await app(scope, receive, adding)

    return wrapped
