"""REST requests observed as gRPC calls are (tests/e2e/test_observability.py): the same
metrics labelled `transport="http"` (requests in flight among them), the same request log
lines with their trace id, and a server span per request that continues the caller's W3C
`traceparent`, with the gRPC call's children (queue, encode, a linked batch; generate for a
decoupled model's request); in the server's own listeners and through front-end processes.
curl in its own process sends every request."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from service.observability.metrics import UNKNOWN
from tests.servers import (
    HTTP_PORT,
    ServerProcess,
    model_repository,
    paused,
    running_server,
)

pytestmark = pytest.mark.e2e

PARENT_ID = "00f067aa0ba902b7"
GOOD = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 256], "data": [0.5] * 256}]}
BAD = {"inputs": [{"name": "no_such_input", "datatype": "FP32", "shape": [1], "data": [1]}]}
WAIT_S = 60.0
Lines = list[dict[str, Any]]


@dataclass(frozen=True)
class Observed:
    server: ServerProcess
    port: int


@pytest.fixture(scope="module", params=["own listeners", "--frontends 2"])
def observed(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Observed]:
    """A server with REST and spans on stderr; its own listeners, or front-end processes that
    pass each REST request on to the parent, where it is observed once."""
    root = tmp_path_factory.mktemp("rest-observability")
    args = [
        *("--http-port", HTTP_PORT, "--trace-console"),
        *("--log-sample-ratio", "0", "--slow-request-ms", "600000"),
        *([] if request.param == "own listeners" else request.param.split()),
    ]
    repository = model_repository(root / "models", ["mlp", "generate"])
    with running_server(repository, root / "server.log", args) as server:
        yield Observed(server, server.http_port)


@dataclass(frozen=True)
class Exchange:
    status: int
    version: str  # the HTTP version curl spoke
    body: bytes


def curl(
    observed: Observed, path: str, body: Any, version: str = "1.1", traceparent: str = ""
) -> Exchange:
    """One POST by curl in its own process (`version`: 1.1, or 2 by prior knowledge)."""
    command = [
        *("curl", "-s", "--http1.1" if version == "1.1" else "--http2-prior-knowledge"),
        *("-w", "\n%{http_code} %{http_version}", "--data-binary", "@-"),
        f"http://127.0.0.1:{observed.port}{path}",
    ]
    if traceparent:
        command += ["-H", f"traceparent: {traceparent}"]
    done = subprocess.run(
        command, input=json.dumps(body).encode(), capture_output=True, timeout=60, check=True
    )
    payload, _, trailer = done.stdout.rpartition(b"\n")
    status, spoken = trailer.decode().split()
    return Exchange(int(status), spoken, payload)


def metric(observed: Observed, name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in observed.server.metrics()
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def new_trace(seed: int) -> tuple[str, str]:
    """A trace id of the test's own and the traceparent that names it, sampled."""
    trace_id = f"{seed:032x}"
    return trace_id, f"00-{trace_id}-{PARENT_ID}-01"


def test_rest_requests_are_counted_as_grpc_calls_are(observed: Observed) -> None:
    """Totals by code and durations, labelled transport="http" and rpc="ModelInfer"."""
    infer = {"transport": "http", "rpc": "ModelInfer", "model": "mlp"}
    ok = {**infer, "code": "OK", "version": "1"}
    bad = {**infer, "code": "INVALID_ARGUMENT", "version": ""}
    durations = "paddlequic_request_duration_seconds_count"
    before = [metric(observed, "paddlequic_requests_total", **labels) for labels in (ok, bad)]
    before.append(metric(observed, durations, **infer))
    for version in ("1.1", "2"):
        assert curl(observed, "/v2/models/mlp/infer", GOOD, version).status == 200
    assert curl(observed, "/v2/models/mlp/infer", BAD).status == 400
    after = [metric(observed, "paddlequic_requests_total", **labels) for labels in (ok, bad)]
    after.append(metric(observed, durations, **infer))
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 1, 3]


def test_a_rest_request_is_in_flight_until_it_is_answered(observed: Observed) -> None:
    """With mlp's worker held still, a REST infer request shows in
    paddlequic_inflight_requests{transport="http"} until it is answered."""
    inflight = "paddlequic_inflight_requests"
    (instance,) = observed.server.instances("mlp")
    answered: list[Exchange] = []
    with paused(instance.pid):
        caller = threading.Thread(
            target=lambda: answered.append(curl(observed, "/v2/models/mlp/infer", GOOD))
        )
        caller.start()
        deadline = time.monotonic() + WAIT_S
        while metric(observed, inflight, transport="http") != 1:
            assert time.monotonic() < deadline, "the request never showed in flight"
            time.sleep(0.05)
    caller.join(WAIT_S)
    assert [a.status for a in answered] == [200]
    deadline = time.monotonic() + WAIT_S
    while metric(observed, inflight, transport="http") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def logged(observed: Observed, wanted: int, match: Callable[[dict[str, Any]], bool]) -> Lines:
    """The server log's JSON objects (log lines, spans) that `match`, once `wanted` of them
    were written (or WAIT_S passed)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        found = [o for o in observed.server.log_objects() if match(o)]
        if len(found) >= wanted or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def spans_of(observed: Observed, trace_id: str, wanted: int) -> Lines:
    return logged(
        observed, wanted, lambda s: s.get("context", {}).get("trace_id") == f"0x{trace_id}"
    )


@pytest.mark.parametrize("version", ["1.1", "2"])
def test_a_rest_request_continues_the_callers_trace(observed: Observed, version: str) -> None:
    """A server span named by its route, the caller's span its parent, the gRPC call's
    children (queue, encode) and the batch that ran it linked to it."""
    trace_id, traceparent = new_trace(0xA11CE + len(version))
    exchange = curl(observed, "/v2/models/mlp/infer", GOOD, version, traceparent)
    assert (exchange.status, exchange.version) == (200, version)
    spans = spans_of(observed, trace_id, 3)
    (server,) = (s for s in spans if s["kind"] == "SpanKind.SERVER")
    assert server["name"] == "POST /v2/models/{model}/infer"
    assert server["parent_id"] == f"0x{PARENT_ID}"
    attributes = server["attributes"]
    assert {k: attributes[k] for k in ("http.request.method", "http.route", "url.path")} == {
        "http.request.method": "POST",
        "http.route": "/v2/models/{model}/infer",
        "url.path": "/v2/models/mlp/infer",
    }
    assert attributes["http.response.status_code"] == 200
    assert attributes["network.protocol.version"] == version
    assert (attributes["paddlequic.transport"], attributes["paddlequic.rpc"]) == (
        "http",
        "ModelInfer",
    )
    assert attributes["paddlequic.model"] == "mlp"
    span_id = server["context"]["span_id"]
    assert sorted(s["name"] for s in spans if s["parent_id"] == span_id) == ["encode", "queue"]

    def links_here(span: dict[str, Any]) -> bool:
        links = span.get("links") or []
        return span.get("name") == "batch" and any(
            link["context"]["span_id"] == span_id for link in links
        )

    (batch,) = logged(observed, 1, links_here)
    assert batch["attributes"]["paddlequic.model"] == "mlp"


def test_a_rest_stream_is_traced_with_its_generation(observed: Observed) -> None:
    trace_id, traceparent = new_trace(0x57EA)
    request = {"text": "Once", "max_tokens": 4}
    exchange = curl(observed, "/v2/models/generate/generate_stream", request, "2", traceparent)
    assert exchange.status == 200
    spans = spans_of(observed, trace_id, 2)
    (server,) = (s for s in spans if s["kind"] == "SpanKind.SERVER")
    assert server["name"] == "POST /v2/models/{model}/generate_stream"
    assert server["attributes"]["paddlequic.rpc"] == "ModelStreamInfer"
    span_id = server["context"]["span_id"]
    assert "generate" in [s["name"] for s in spans if s["parent_id"] == span_id]


def test_rest_failures_are_logged_with_their_trace(observed: Observed) -> None:
    """A failed request's log line names it as a gRPC call's does, its trace id the
    caller's; a request no route takes is logged too, under no method's name (UNKNOWN)."""
    trace_id, traceparent = new_trace(0xBAD)
    assert curl(observed, "/v2/models/mlp/infer", BAD, "2", traceparent).status == 400
    assert curl(observed, "/v2/nowhere", {}).status == 404

    def failure(line: dict[str, Any]) -> bool:
        return (
            line.get("event") == "request"
            and line.get("transport") == "http"
            and (line.get("trace_id") == trace_id or "/v2/nowhere" in line.get("error", ""))
        )

    lines = logged(observed, 2, failure)
    traced = [line for line in lines if line.get("trace_id") == trace_id]
    unrouted = [line for line in lines if line["rpc"] == UNKNOWN]
    (line,) = traced
    assert (line["rpc"], line["status"], line["model"]) == ("ModelInfer", "INVALID_ARGUMENT", "mlp")
    assert "no_such_input" in line["error"]
    assert any("/v2/nowhere" in u["error"] and "trace_id" not in u for u in unrouted)
