"""The metrics endpoint: the server's own families as prometheus_client writes them, and Python
models' own families (pb_utils.MetricFamily) in the Prometheus text format as Triton writes them.

prometheus_client's text format names a counter family `NAME_total` on its HELP and TYPE lines
whatever its samples are called; Triton's (prometheus-cpp's) names the family as its model
did, on those lines and its samples alike, and Triton's custom_metrics example looks for
`# TYPE NAME counter`. A scraper asking for OpenMetrics gets prometheus_client's OpenMetrics
writer over every family, as before."""

from __future__ import annotations

import gzip
import math
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder, gzip_accepted
from prometheus_client.openmetrics.exposition import escape_label_name
from prometheus_client.registry import Collector

from service.workers.model_metrics import Family

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


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

    def __init__(self, registry: CollectorRegistry, models: Callable[[], Iterator[Any]]) -> None:
        self._registry = registry
        self._models = models

    def collect(self) -> Iterator[Any]:
        yield from self._registry.collect()
        yield from self._models()


def metrics_app(
    registry: CollectorRegistry,
    model_families: Callable[[], list[Family]],
    model_metrics: Callable[[], Iterator[Any]],
) -> Callable[[dict[str, Any], StartResponse], list[bytes]]:
    """The WSGI application of /metrics (any path, as prometheus_client's): `registry` is the
    server's own; `model_families` the models' (for the text format), `model_metrics` the same
    as Metric objects (for OpenMetrics). `?name[]=` chooses among the server's families as
    prometheus_client does (and leaves the models' out)."""
    everything = CollectorRegistry(auto_describe=False)
    everything.register(_Both(registry, model_metrics))

    def app(environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
        if environ.get("PATH_INFO") == "/favicon.ico":
            start_response("200 OK", [])
            return [b""]
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
        if names:
            body = encoder(registry.restricted_registry(names))
        elif encoder is generate_latest:
            body = generate_latest(registry) + families_text(model_families())
        else:
            body = encoder(everything)
        headers = [("Content-Type", content_type)]
        if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
            body = gzip.compress(body)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]

    return app


class _Silent(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (prometheus_client's server logs none either)."""


def serve(
    host: str, port: int, app: Callable[[dict[str, Any], StartResponse], list[bytes]]
) -> ThreadingWSGIServer:
    """The HTTP server of `app` on host:port, in a daemon thread of its own (`server_port`,
    `shutdown()`). An OSError if the port cannot be bound."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    httpd: ThreadingWSGIServer = make_server(host, port, app, server_class, handler_class=_Silent)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return httpd
