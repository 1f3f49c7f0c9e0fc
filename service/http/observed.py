"""A REST request observed as a gRPC call is (service/observability/observer.py's
`Observation`): counted in the same metrics (in flight, totals, durations) and request log,
labelled `transport="http"` and by the gRPC method its route stands for, and traced in a server
span that continues the caller's W3C `traceparent` header, named and described by OpenTelemetry's
HTTP conventions (`POST /v2/models/{model}/infer`), whose children (queue, batch links, encode,
generate) are those of the gRPC call."""

from __future__ import annotations

from collections.abc import Iterator
from contextvars import Token
from dataclasses import dataclass

import grpc
from opentelemetry.context import Context as OtelContext

from service.http.asgi import Scope
from service.http.body_budget import BodyCharge
from service.inference.identity import ANYONE, Identity
from service.observability.metrics import UNKNOWN
from service.observability.observer import Observation, Observer

TRANSPORT = "http"  # the transport label of REST calls
# The request headers a trace is carried in (W3C trace context); others are never read.
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})


@dataclass
class Call:
    """What the request log, metrics and trace say of one request: the gRPC method its route
    stands for (the same labels as gRPC's calls, `transport="http"`), its model and outcome;
    once routed, its observation (`observe`)."""

    rpc: str = UNKNOWN
    model: str = ""
    version: str = ""
    request_id: str = ""
    code: grpc.StatusCode = grpc.StatusCode.OK
    error: str = ""
    encoding: str | None = None  # the response's Content-Encoding (None: identity)
    client: str = ""  # whom it counts against for a fair share: certificate, else address
    identity: Identity = ANYONE  # its client certificate's (service/http/callers.py)
    observation: Observation | None = None  # a routed request's
    trace: Token[OtelContext] | None = None  # its span made current, until it ends
    started: float = 0.0  # perf_counter() when it came
    recorded: bool = False  # counted and logged (or passed on, to be counted elsewhere)
    charge: BodyCharge | None = None  # what its body holds of the receive budget, once admitted

    def held(self) -> BodyCharge:
        """Its charge, which RestApp gives every request it admits before routing it."""
        if self.charge is None:
            raise RuntimeError("a REST request's body read before the request was admitted")
        return self.charge


def observe(observer: Observer, scope: Scope, rpc: str, route: str) -> Observation:
    """The observation of a request routed to `route` (its template: `{model}` for the model's
    name), standing for the gRPC method `rpc`: started now, ended by the caller."""
    method = scope["method"]
    attributes = {
        "http.request.method": method,
        "http.route": route,
        "url.path": scope["path"],
        "url.scheme": scope.get("scheme", "http"),
        "network.protocol.version": scope.get("http_version", ""),
        "paddlequic.rpc": rpc,
    }
    return Observation(
        observer,
        TRANSPORT,
        "/" + rpc,
        lambda: _trace_headers(scope),
        (f"{method} {route}", attributes),
    )


def _trace_headers(scope: Scope) -> Iterator[tuple[str, str]]:
    for name, value in scope["headers"]:
        if name in TRACE_HEADERS:
            yield bytes(name).decode("latin-1"), bytes(value).decode("latin-1")
