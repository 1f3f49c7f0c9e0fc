"""The metrics endpoint: the server's own families as prometheus_client writes them, and Python
models' own families (pb_utils.MetricFamily) in the Prometheus text format as Triton writes them.

prometheus_client's text format names a counter family `NAME_total` on its HELP and TYPE lines
whatever its samples are called; Triton's (prometheus-cpp's) names the family as its model
did, on those lines and its samples alike, and Triton's custom_metrics example looks for
`# TYPE NAME counter`. A scraper asking for OpenMetrics gets prometheus_client's OpenMetrics
writer over every family, as before."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gzip
import logging
import math
import selectors
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder, gzip_accepted
from prometheus_client.openmetrics.exposition import escape_label_name
from prometheus_client.registry import Collector

from service.observability.scrape_bounds import ScrapeConnections, ScrapeLimits
from service.observability.summed import Restricted
from service.workers.model_metrics import Family

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
log = logging.getLogger("paddlequic.metrics")


def families_text(families: Iterable[Family]) -> bytes:
    """Models' families in the Prometheus text format, each named as its model named it."""
    lines: list[str] = []
    for family in families:
        help_text = family.description.replace("\\", r"\\").replace("\n", r"\n")
        lines.append(f"# HELP {family.name} {help_text}\n")
        lines.append(f"# TYPE {family.name} {family.kind}\n")
        for labels, series in family.series.items():
            names = dict(labels)
            if family.kind != "histogram":
                lines.append(_sample(family.name, names, series.value))
                continue
            cumulative = 0
            for bound, count in zip((*series.buckets, math.inf), series.counts, strict=True):
                cumulative += count
                le = "+Inf" if bound == math.inf else str(bound)
                lines.append(_sample(f"{family.name}_bucket", {**names, "le": le}, cumulative))
            lines.append(_sample(f"{family.name}_count", names, series.count))
            lines.append(_sample(f"{family.name}_sum", names, series.value))
    return "".join(lines).encode()


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    escaped = (
        v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"") for v in labels.values()
    )
    pairs = ",".join(f'{escape_label_name(k)}="{v}"' for k, v in zip(labels, escaped, strict=True))
    return f"{name}{{{pairs}}} {_number(value)}\n" if pairs else f"{name} {_number(value)}\n"


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Both(Collector):
    """The server's families and the models' as prometheus_client's Metric objects."""

    def __init__(self, server: Collector, models: Callable[[], Iterator[Any]]) -> None:
        self._server = server
        self._models = models

    def collect(self) -> Iterator[Any]:
        yield from self._server.collect()
        yield from self._models()


def metrics_app(
    server: Collector,
    model_families: Callable[[], list[Family]],
    model_metrics: Callable[[], Iterator[Any]],
    refresh: Callable[[], None] = lambda: None,
) -> Callable[[dict[str, Any], StartResponse], list[bytes]]:
    """The WSGI application of /metrics (any path, as prometheus_client's): `server` gives
    the server's own families; `model_families` the models' (for the text format),
    `model_metrics` the same as Metric objects (for OpenMetrics). `?name[]=` chooses among the
    server's samples as prometheus_client does (and leaves the models' out). `refresh` runs
    before each scrape (front-ends asked for their latest counts)."""
    everything = CollectorRegistry(auto_describe=False)
    everything.register(_Both(server, model_metrics))

    def app(environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
        if environ.get("PATH_INFO") == "/favicon.ico":
            start_response("200 OK", [])
            return [b""]
        refresh()
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
        if names:
            body = encoder(Restricted(server, frozenset(names)))
        elif encoder is generate_latest:
            body = generate_latest(server) + families_text(model_families())
        else:
            body = encoder(everything)
        headers = [("Content-Type", content_type)]
        if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
            body = gzip.compress(body)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]

    return app


def on_loop(
    loop: asyncio.AbstractEventLoop, refresh: Callable[[], Awaitable[None]], timeout: float
) -> Callable[[], None]:
    """`refresh` for the metrics server's thread: run on `loop`, waited for up to `timeout`
    seconds; a scrape when the loop is gone or late writes what it has."""

    async def run() -> None:
        await refresh()

    def blocking() -> None:
        if loop.is_closed():
            return
        try:
            future = asyncio.run_coroutine_threadsafe(run(), loop)
        except RuntimeError:  # closed since
            return
        try:
            future.result(timeout)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            future.cancel()

    return blocking


class _Silent(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (prometheus_client's server logs none either)."""


class MetricsServer(ThreadingWSGIServer):
    """Sleeps in the kernel between scrapes. socketserver's serve_forever wakes every
    poll_interval to look whether shutdown() was asked: at 0.05 s (a stop waits for the next
    look) that was an idle server's most frequent wake-up; here shutdown() wakes the thread
    through a socket pair instead. It holds at most `limits.max_connections` at once, each for
    at most `limits.timeout_s` (scrape_bounds.py): its loop wakes at the next one's time while
    it holds any, never while it holds none."""

    limits = ScrapeLimits()
    # Connections the kernel completes before this loop accepts them (socketserver's 5 left a
    # burst of peers in the kernel's queue, each accepted only as others were closed, instead
    # of all taken at once and those past the bound closed).
    request_queue_size = 128

    def server_activate(self) -> None:
        super().server_activate()
        # handle_request() then never waits: a connection gone between the select() that
        # saw it and the accept() is no reason to stop looking at the wake-up socket.
        self.socket.setblocking(False)
        self._wake, self._waker = socket.socketpair()
        self._stopped = threading.Event()
        # Taken by this loop and by each connection's thread as it closes its socket: a
        # connection is shut past its time only while it is held, so never once closed.
        self._lock = threading.Lock()
        self._held: ScrapeConnections[socket.socket] = ScrapeConnections(self.limits)

    def serve_until_shutdown(self) -> None:
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self, selectors.EVENT_READ)
                selector.register(self._wake, selectors.EVENT_READ)
                while True:
                    ready = selector.select(self._next_look())
                    if any(key.fileobj is self._wake for key, _ in ready):
                        break
                    if ready:
                        self.handle_request()
                    self._shut_expired()
        finally:
            self._stopped.set()

    def _next_look(self) -> float | None:
        with self._lock:
            deadline = self._held.next_deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _shut_expired(self) -> None:
        """Connections past their time shut both ways: the thread reading or writing one
        then ends (wsgiref takes a connection ended by its peer quietly)."""
        with self._lock:
            for connection in self._held.expired(time.monotonic()):
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection, if held; else it is closed at once."""
        with self._lock:
            held = self._held.admit(request, time.monotonic())
        if held:
            super().process_request(request, client_address)
        else:
            self.shutdown_request(request)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._held.ended(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line in the log, not socketserver's traceback on stderr: a connection that
        broke, or was shut at its time, is the peer's doing."""
        log.debug("a /metrics connection from %s failed: %r", client_address, sys.exc_info()[1])

    def shutdown(self) -> None:
        """Stops serve_until_shutdown and waits until it has (as socketserver's does)."""
        self._waker.send(b"\0")
        self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        self._wake.close()
        self._waker.close()


def serve(
    host: str,
    port: int,
    app: Callable[[dict[str, Any], StartResponse], list[bytes]],
    limits: ScrapeLimits,
) -> MetricsServer:
    """The HTTP server of `app` on host:port, in a daemon thread of its own (`server_port`,
    `shutdown()`). An OSError if the port cannot be bound."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    attributes = {"address_family": family, "limits": limits}
    server_class = type("MetricsServer", (MetricsServer,), attributes)
    httpd: MetricsServer = make_server(host, port, app, server_class, handler_class=_Silent)
    thread = threading.Thread(target=httpd.serve_until_shutdown, name="metrics", daemon=True)
    thread.start()
    return httpd
