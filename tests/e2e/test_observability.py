"""Metrics, traces and request logs of the real server, over both transports."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.inference_client import build_request
from clients.quic_channel import QuicChannel
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1 import testing_pb2, testing_pb2_grpc
from service.observability.logs import sampled_by_id
from tests.servers import (
    METRICS_PORT,
    ServerProcess,
    closed_by_peer,
    json_lines,
    model_repository,
    running_server,
)

GOOD = {"input": np.ones((1, 256), np.float32)}
BAD = {"no_such_input": np.ones((1, 256), np.float32)}  # -> INVALID_ARGUMENT
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
LOG_WAIT_S = 60.0
METRICS_HELD = 4  # the server's --metrics-max-connections
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Observed:
    def __init__(self, server: ServerProcess, certs: Path, metrics_port: int) -> None:
        self.server = server
        self.certs = certs
        self.metrics_port = metrics_port
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    root = tmp_path_factory.mktemp("observability")
    args = [
        *("--certs-dir", str(root / "certs"), "--metrics-port", METRICS_PORT),
        *("--log-sample-ratio", "0", "--log-sample-seed", "1", "--slow-request-ms", "600000"),
        *("--trace-console", "--testing-service"),
        *("--metrics-max-connections", str(METRICS_HELD), "--metrics-timeout", "3"),
    ]
    repository = model_repository(root / "models", ["mlp"])
    with running_server(repository, root / "server.log", args) as server:
        yield Observed(server, root / "certs", server.metrics_port)


def channel(observed: Observed, transport: str) -> grpc.aio.Channel | QuicChannel:
    """A new channel; create it inside the event loop that uses it."""
    if transport == "h2":
        return grpc.aio.insecure_channel(observed.server.address)
    ca_file = str(observed.certs / "ca.pem")
    return QuicChannel(f"localhost:{observed.server.port}", ca_file=ca_file)


async def infer(
    observed: Observed, transport: str, inputs: dict[str, Any], request_id: str, **kw: Any
) -> grpc.StatusCode:
    """One ModelInfer over `transport`; its status code."""
    request = build_request("mlp", inputs, request_id=request_id)
    async with channel(observed, transport) as ch:
        try:
            await pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(request, timeout=30, **kw)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def scrape(observed: Observed) -> Samples:
    with urllib.request.urlopen(observed.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def log_objects(observed: Observed, wanted: int, match: Any) -> list[dict[str, Any]]:
    """The server log's JSON lines that `match`, once `wanted` of them were written."""
    deadline = time.monotonic() + 10
    while True:
        found = [obj for obj in observed.server.log_objects() if match(obj)]
        if len(found) >= wanted or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_metrics_holds_its_connections_bound_each_for_its_time(observed: Observed) -> None:
    """Peers that connect to /metrics and never finish a request hold at most
    --metrics-max-connections of the server's threads, each until --metrics-timeout: those
    past the bound are closed as they come, the others when their time is up."""
    threads = f"/proc/{observed.server.process.pid}/task"
    before = len(os.listdir(threads))
    address = ("127.0.0.1", observed.metrics_port)
    with contextlib.ExitStack() as stack:
        idle = [stack.enter_context(socket.create_connection(address)) for _ in range(40)]
        for connection in idle:
            connection.sendall(b"GET /metr")
        # Unbounded, the server took a thread for each of the 40 and kept them.
        time.sleep(0.5)  # for threads to start, were they to: not a timing asserted on
        assert len(os.listdir(threads)) - before <= METRICS_HELD + 4  # others come and go
        for connection in idle:
            assert closed_by_peer(connection, 30)  # a bound on the wait: closed by 3 s
    # A scrape is answered once they are gone.
    assert any(name == "paddlequic_inflight_requests" for name, _ in scrape(observed))


async def test_requests_are_counted_per_transport_and_code(observed: Observed) -> None:
    before = scrape(observed)
    for transport in ("h2", "h3"):
        for i in range(3):
            assert await infer(observed, transport, GOOD, f"count-ok-{i}") == grpc.StatusCode.OK
        for i in range(2):
            code = await infer(observed, transport, BAD, f"count-bad-{i}")
            assert code == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(observed)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    infer_labels = {"model": "mlp", "rpc": "ModelInfer"}
    for transport in ("h2", "h3"):
        ok = {**infer_labels, "transport": transport, "code": "OK", "version": "1"}
        bad = {**infer_labels, "transport": transport, "code": "INVALID_ARGUMENT", "version": ""}
        assert delta("paddlequic_requests_total", **ok) == 3
        assert delta("paddlequic_requests_total", **bad) == 2
        duration = {**infer_labels, "transport": transport}
        assert delta("paddlequic_request_duration_seconds_count", **duration) == 5
        assert value(after, "paddlequic_inflight_requests", transport=transport) == 0
    # Six one-row requests ran, in however many batches.
    assert delta("paddlequic_batch_size_sum", model="mlp") == 6
    assert delta("paddlequic_batch_size_count", model="mlp") >= 1
    assert delta("paddlequic_compute_duration_seconds_count", model="mlp") >= 1
    assert delta("paddlequic_queue_duration_seconds_count", model="mlp") == 6
    assert value(after, "paddlequic_queue_depth", model="mlp", version="1") == 0
    assert value(after, "paddlequic_worker_restarts_total", model="mlp") == 0
    assert delta("paddlequic_h3_connections_total") == 5  # a new connection per call
    assert value(after, "paddlequic_h3_handshakes_total", kind="full") >= 5
    assert value(after, "process_resident_memory_bytes") > 0


@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_streams_and_deadlines_are_counted(observed: Observed, transport: str) -> None:
    """A stream takes its model from its first request; a handler stopped by the deadline
    counts as DEADLINE_EXCEEDED (streaming and unary behaviors are wrapped differently)."""
    before = scrape(observed)

    async with channel(observed, transport) as ch:
        requests = [build_request("mlp", GOOD), build_request("mlp", BAD)]
        stream = pb_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer(iter(requests))
        assert len([r async for r in stream]) == 2
        testing = testing_pb2_grpc.TestingStub(ch)
        slow = testing_pb2.EchoRequest(sleep_seconds=60, response_count=1)
        with pytest.raises(grpc.aio.AioRpcError):
            await testing.Unary(slow, timeout=2)
        with pytest.raises(grpc.aio.AioRpcError):
            await testing.ServerStream(slow, timeout=2).read()
    expected = {
        ("ModelStreamInfer", "mlp", "OK"): 1,
        ("Unary", "", "DEADLINE_EXCEEDED"): 1,
        ("ServerStream", "", "DEADLINE_EXCEEDED"): 1,
    }

    def count(samples: Samples, rpc: str, model: str, code: str) -> float:
        labels = {"rpc": rpc, "model": model, "code": code, "version": "", "transport": transport}
        return value(samples, "paddlequic_requests_total", **labels)

    deadline = time.monotonic() + 60
    while True:  # the server records a call when its handler has finished
        after = scrape(observed)
        counted = {key: count(after, *key) - count(before, *key) for key in expected}
        if counted == expected or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert counted == expected


async def test_spans_continue_the_callers_trace_on_both_transports(observed: Observed) -> None:
    for transport in ("h2", "h3"):
        traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
        metadata = (("traceparent", traceparent),)
        code = await infer(observed, transport, GOOD, f"trace-{transport}", metadata=metadata)
        assert code == grpc.StatusCode.OK

    def ours(span: dict[str, Any]) -> bool:
        return bool(span.get("context", {}).get("trace_id") == f"0x{TRACE_ID}")

    spans = log_objects(observed, 6, ours)
    servers = {
        s["attributes"]["paddlequic.transport"]: s
        for s in spans
        if s["name"] == "inference.GRPCInferenceService/ModelInfer"
    }
    assert sorted(servers) == ["h2", "h3"]
    for server_span in servers.values():
        assert server_span["kind"] == "SpanKind.SERVER"
        assert server_span["parent_id"] == f"0x{PARENT_ID}"
        assert server_span["attributes"]["rpc.method"] == "ModelInfer"
        assert server_span["attributes"]["paddlequic.model"] == "mlp"
        span_id = server_span["context"]["span_id"]
        children = [s["name"] for s in spans if s["parent_id"] == span_id]
        assert sorted(children) == ["encode", "queue"]

        # The batch that ran the request is a span of its own, linked to every request in it.
        def links_to(span: dict[str, Any], request_span: str) -> bool:
            links = span.get("links") or []
            return span.get("name") == "batch" and any(
                link["context"]["span_id"] == request_span for link in links
            )

        (batch,) = log_objects(observed, 1, lambda s, here=span_id: links_to(s, here))
        assert batch["attributes"]["paddlequic.model"] == "mlp"
        assert batch["attributes"]["paddlequic.batch_size"] >= 1


def logged_request_ids(log_text: str, prefix: str) -> set[str]:
    """The ids of the request-log lines in `log_text` whose id starts with `prefix`."""
    return {
        line["request_id"]
        for line in json_lines(log_text)
        if line.get("event") == "request" and line["request_id"].startswith(prefix)
    }


def wait_logged(log_text: Callable[[], str], request_id: str) -> None:
    """Until the line of `request_id` is in the log. Sent after others, it proves their lines
    would be there by now: a request's line is written when its call ends, and calls made one
    after another end in that order."""
    deadline = time.monotonic() + LOG_WAIT_S
    while request_id not in logged_request_ids(log_text(), request_id):
        assert time.monotonic() < deadline, f"no log line for {request_id}"
        time.sleep(0.1)


async def test_errors_are_logged_and_unsampled_successes_are_not(observed: Observed) -> None:
    for transport in ("h2", "h3"):
        assert await infer(observed, transport, GOOD, f"log-ok-{transport}") == grpc.StatusCode.OK
        code = await infer(observed, transport, BAD, f"log-bad-{transport}")
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        ok = await infer(observed, transport, GOOD, f"log-ok-last-{transport}")
        assert ok == grpc.StatusCode.OK
    # A failure after the last success: once its line is written, a success's would be too.
    code = await infer(observed, "h2", BAD, "log-bad-end")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    wait_logged(observed.server.log_text, "log-bad-end")

    def request_line(obj: dict[str, Any]) -> bool:
        return obj.get("event") == "request" and obj["request_id"].startswith("log-")

    lines = log_objects(observed, 3, request_line)
    assert sorted(line["request_id"] for line in lines) == [
        "log-bad-end",
        "log-bad-h2",
        "log-bad-h3",
    ]
    for line in lines:
        assert line["level"] == "warning"
        assert {line["transport"], line["rpc"], line["status"]} <= {"h2", "h3"} | {
            "ModelInfer",
            "INVALID_ARGUMENT",
        }
        assert (line["model"], line["version"]) == ("mlp", "")
        assert "no_such_input" in line["error"]
        assert isinstance(line["latency_ms"], float)
        assert len(line["trace_id"]) == 32
        assert line["timestamp"] and line["message"]
    every_request = log_objects(observed, 0, lambda obj: obj.get("event") == "request")
    assert all(line["status"] != "OK" for line in every_request)


def test_successes_are_sampled_at_the_configured_ratio(tmp_path: Path) -> None:
    """Seeded: which successes are logged follows from their ids alone."""
    ratio, seed = 0.3, 7
    args = ["--no-h3", "--log-sample-ratio", str(ratio), "--log-sample-seed", str(seed)]
    repo = model_repository(tmp_path / "models", ["mlp"])
    with running_server(repo, tmp_path / "log", args) as server:
        ids = [f"sample-{i}" for i in range(40)]
        for request_id in ids:
            request = build_request(
                "mlp", {"input": np.ones((1, 256), np.float32)}, request_id=request_id
            )
            server.stub.ModelInfer(request, timeout=30)
        # A failure after the last success: once its line is written, a success's would be too.
        with pytest.raises(grpc.RpcError):
            server.stub.ModelInfer(build_request("mlp", BAD, request_id="end"), timeout=30)
        wait_logged(server.log_text, "end")
        expected = {i for i in ids if sampled_by_id(seed, i, ratio)}
        assert 0 < len(expected) < len(ids)
        assert logged_request_ids(server.log_text(), "sample-") == expected
