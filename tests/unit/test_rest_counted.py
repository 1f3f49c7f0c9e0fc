"""A REST call is counted before its response's last bytes leave: a client that has its whole
answer and then reads /metrics finds its call there (CI once read /metrics first)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from service.http.app import RestApp
from service.http.batchstream import BatchStreams
from service.http.bounds import RequestLimits
from service.http.event_stream import relay
from service.http.generate_route import GenerateRoute
from service.http.infer_route import InferRoute
from service.http.observed import Call
from service.http.openai import Completions
from service.http.router import InferRouter
from service.inference import errors
from service.observability.logs import LineBudget, RequestLog
from service.observability.metrics import Metrics
from service.observability.observer import Observer
from service.placement.topology import cpu_only_topology
from service.registry.versions import ModelRegistry

LIMITS = RequestLimits(
    max_header_bytes=64,
    max_body_bytes=1024,
    body_timeout_s=5.0,
    max_requests=8,
    stall_s=5.0,
    receive_budget=1 << 20,
    receive_budget_per_address=1 << 20,
)


def calls_counted(metrics: Metrics) -> float:
    return sum(
        s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == "paddlequic_requests_total"
    )


async def never() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def test_a_whole_answer_is_counted_before_its_body_is_sent() -> None:
    metrics = Metrics(ModelRegistry(lambda: None), cpu_only_topology())
    observer = Observer(metrics, RequestLog(1e9, 0.0, None, LineBudget(10, 1.0)), None)
    # No route is reached: the request is refused before it is routed.
    inference, generation = InferRoute.__new__(InferRoute), GenerateRoute.__new__(GenerateRoute)
    completions = Completions.__new__(Completions)
    batchstream = BatchStreams.__new__(BatchStreams)
    router = InferRouter(inference, generation, completions, LIMITS, observer, None, batchstream)
    app = RestApp(router)
    counted_at: dict[str, float] = {}

    async def send(message: dict[str, Any]) -> None:
        counted_at[message["type"]] = calls_counted(metrics)

    # Headers past --max-metadata-bytes: answered (431) by the app before any route runs.
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v2/models/m/infer",
        "http_version": "2",
        "headers": [(b"x-padding", b"x" * 200)],
        "client": ("127.0.0.1", 1),
    }
    await app(scope, never, send)
    assert counted_at == {"http.response.start": 0, "http.response.body": 1}
    assert calls_counted(metrics) == 1


@settings(max_examples=30, deadline=None)
@given(events=st.integers(0, 4), fails=st.booleans())
def test_a_stream_is_ended_before_its_last_message(events: int, fails: bool) -> None:
    sent: list[tuple[bool, bytes]] = []  # (ended by then, body)
    ended: list[bool] = []

    async def stream() -> AsyncGenerator[bytes, None]:
        for i in range(events):
            yield b"event %d" % i
        if fails:
            raise errors.ServiceError(grpc.StatusCode.INTERNAL, "the model failed")

    async def send(message: dict[str, Any]) -> None:
        sent.append((bool(ended), message["body"]))

    asyncio.run(relay(stream(), send, never, Call(), 5.0, lambda: ended.append(True)))
    more = [b"event %d" % i for i in range(events)]
    assert [body for _, body in sent[:events]] == more
    assert not any(was_ended for was_ended, _ in sent[:events])
    assert sent[events][0], "the stream's end went out before the call was ended"
