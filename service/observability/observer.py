"""What is done with each finished call (metrics, request log, span): the `Observer`, and
`Observation`, one call's, as plain functions, so a call with no task or servicer context of
its own (one a front-end described) is observed by the same code as the calls of the wrapped
behaviors (handlers.py)."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import Token
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context as OtelContext
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, Tracer

from service.inference.jobs import Answer, Timings
from service.observability.logs import RequestLog
from service.observability.metrics import UNKNOWN, Metrics
from transport.h3.calls import TransportAnswer

# How close to its deadline (on the server's clock) a client's cancel counts as that deadline.
# The client's clock starts before the request reaches the server, and on a loaded host the
# headers can wait well over 100 ms to be read: with 0.1 s, a call timed out by its client was
# now and then counted CANCELLED. A caller cancelling on purpose this close to its own
# deadline is counted DEADLINE_EXCEEDED, which it nearly was.
DEADLINE_MARGIN_S = 0.5
_NO_SPAN = contextlib.nullcontext()
Metadata = tuple[tuple[str, Any], ...]


def _sampled(requests: Sequence[SpanContext]) -> list[SpanContext]:
    """The requests' spans a batch span links to: those being recorded."""
    return [c for c in requests if c.is_valid and c.trace_flags.sampled]


def _batch_attributes(
    model: str, version: int, rows: int, requests: Sequence[SpanContext]
) -> dict[str, str | int]:
    return {
        "paddlequic.model": model,
        "paddlequic.version": str(version),
        "paddlequic.batch_size": rows,
        "paddlequic.requests": len(requests),
    }


class Observer:
    """What is done with each finished RPC (metrics, request log, span), and the hook for
    what only the request path (service/serving) and the lifecycle know (queue, batch, load
    failures)."""

    def __init__(
        self,
        metrics: Metrics | None,
        request_log: RequestLog,
        tracer: Tracer | None,
        trace_ratio: float = 1.0,
    ):
        self.metrics = metrics
        self.request_log = request_log
        self.tracer = tracer
        self.trace_ratio = trace_ratio
        self._random = random.Random()

    def sample_new(self) -> bool:
        return self._random.random() < self.trace_ratio

    def on_request(self, model: str, elapsed_ns: int, answer: Answer) -> None:
        """One inference request done: its queue wait, as a child span of the RPC's span
        (times reconstructed from the measured durations)."""
        if self.metrics is not None:
            self.metrics.child(self.metrics.queue_duration, model).observe(answer.queue_ns / 1e9)
        if self.tracer is None or not trace.get_current_span().is_recording():
            return
        end = time.time_ns()
        start = end - elapsed_ns
        queued = min(start + answer.queue_ns, end)
        self.tracer.start_span("queue", start_time=start).end(end_time=queued)

    def batch_span(
        self, model: str, version: int, rows: int, requests: Sequence[SpanContext]
    ) -> contextlib.AbstractContextManager[Any]:
        """A span for one batch execution, linked to the span of every request in it (a batch
        belongs to several traces, so it starts its own)."""
        sampled = _sampled(requests)
        if self.tracer is None or not sampled:
            return contextlib.nullcontext()
        return self.tracer.start_as_current_span(
            "batch",
            context=OtelContext(),
            links=[Link(c) for c in sampled],
            attributes=_batch_attributes(model, version, rows, requests),
        )

    def batch_ran(
        self, model: str, version: int, rows: int, requests: Sequence[SpanContext], spent_ns: int
    ) -> None:
        """batch_span for a batch a worker formed and ran on its own (--instance-queues),
        told once it ended: its times reconstructed from what the worker measured."""
        sampled = _sampled(requests)
        if self.tracer is None or not sampled:
            return
        end = time.time_ns()
        span = self.tracer.start_span(
            "batch",
            context=OtelContext(),
            links=[Link(c) for c in sampled],
            attributes=_batch_attributes(model, version, rows, requests),
            start_time=end - spent_ns,
        )
        span.end(end_time=end)

    def encode_span(self) -> contextlib.AbstractContextManager[Any]:
        """Building the response, as a child of the RPC's span."""
        if self.tracer is None or not trace.get_current_span().is_recording():
            return contextlib.nullcontext()
        return self.tracer.start_as_current_span("encode")

    def record(
        self,
        transport: str,
        rpc: str,
        model: str,
        version: str,
        code: grpc.StatusCode,
        seconds: float,
        fields: dict[str, Any],
        details: Callable[[], str],
    ) -> None:
        """One finished call in the metrics and the request log (`details`: the error, asked
        for only when the line is logged)."""
        metrics = self.metrics
        if metrics is not None:
            # The rpc label is bounded by construction: registered methods, or UNKNOWN.
            model, version = metrics.names.labels(model, version)
            metrics.child(metrics.requests, model, version, transport, rpc, code.name).inc()
            metrics.child(metrics.request_duration, model, transport, rpc).observe(seconds)
        latency_ms = round(seconds * 1e3, 3)
        if self.request_log.wanted(code, latency_ms, fields.get("request_id", "")):
            if code is not grpc.StatusCode.OK:
                fields["error"] = details()
            self.request_log.emit(code, latency_ms, fields)

    def transport_answered(self, transport: str, answer: TransportAnswer) -> None:
        """A call its transport answered before any handler ran: counted and logged as the
        others, under its method if it has one (`UNKNOWN` otherwise: the label stays
        bounded whatever paths peers send)."""
        rpc = answer.method_path.rpartition("/")[2] if answer.registered else UNKNOWN
        fields = {"model": "", "version": "", "transport": transport, "rpc": rpc}
        self.record(
            transport, rpc, "", "", answer.code, answer.seconds, fields, lambda: answer.details
        )

    def on_batch(self, model: str, rows: int, timings: Timings) -> None:
        if self.metrics is not None:
            self.metrics.observe_batch(model, rows, timings)

    def on_generated(self, model: str) -> None:
        """A decoupled model sent one data response (from its worker's socket)."""
        if self.metrics is not None:
            self.metrics.child(self.metrics.generated_tokens, model).inc()

    def on_sequences(self, model: str, event: str, count: int) -> None:
        if self.metrics is not None:
            self.metrics.child(self.metrics.sequences, model, event).inc(count)

    def on_generation(self, model: str, delta: int) -> None:
        if self.metrics is not None:
            self.metrics.child(self.metrics.active_generations, model).inc(delta)

    def on_stream_response(self, model: str, seconds: float, first: bool) -> None:
        if self.metrics is not None:
            metrics = self.metrics
            histogram = metrics.time_to_first_token if first else metrics.inter_token
            metrics.child(histogram, model).observe(seconds)

    @contextlib.contextmanager
    def generation_span(self, model: str, request_id: str) -> Iterator[trace.Span | None]:
        """A span per decoupled request, a child of the RPC's (a stream carries many); the
        caller sets its response count. Not made current: the request's generator resumes
        on every response."""
        # The current span may be another process's (a front-end's stream, continued).
        current = trace.get_current_span().get_span_context()
        if self.tracer is None or not (current.is_valid and current.trace_flags.sampled):
            yield None
            return
        attributes = {"paddlequic.model": model, "paddlequic.request_id": request_id}
        span = self.tracer.start_span("generate", attributes=attributes)
        try:
            yield span
        finally:
            span.end()

    def on_load_failure(self, model: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.load_failures.labels(model, reason).inc()

    def on_model_load(self, model: str, trigger: str) -> None:
        if self.metrics is not None:
            self.metrics.model_loads.labels(model, trigger).inc()

    def on_eviction(self, model: str) -> None:
        if self.metrics is not None:
            self.metrics.model_evictions.labels(model).inc()

    def on_load_wait(self, model: str) -> None:
        if self.metrics is not None:
            self.metrics.model_load_waits.labels(model).inc()

    def on_model_memory(self, model: str, size: int | None) -> None:
        if self.metrics is None:
            return
        if size is not None:
            self.metrics.model_memory.labels(model).set(size)
        else:
            with contextlib.suppress(KeyError):
                self.metrics.model_memory.remove(model)

    def on_fallback(self, model: str, fallback: str) -> None:
        if self.metrics is not None:
            self.metrics.child(self.metrics.fallbacks, model, fallback).inc()

    def on_stream_stall(self) -> None:
        if self.metrics is not None:
            self.metrics.stream_stalls.inc()


class Observation:
    """One call being observed: started at construction, recorded once by `end`. Plain
    functions, so a call with no task or servicer context of its own (one a front-end
    described) is observed by the same code as the wrapped behaviors' calls."""

    def __init__(
        self,
        observer: Observer,
        transport: str,
        method_path: str,
        metadata: Callable[[], Iterable[tuple[str, Any]] | None],
        span: tuple[str, dict[str, Any]] | None = None,
    ) -> None:
        """`metadata`: the call's (a REST request's headers), asked for only when tracing may
        need it; `span`: the name and attributes of the call's span where they are not a gRPC
        call's (a REST request's: HTTP's)."""
        self.observer = observer
        self.transport = transport
        self.service, _, self.rpc = method_path.lstrip("/").rpartition("/")
        self.model = self.version = self.request_id = ""
        self.started = time.perf_counter_ns()
        if observer.metrics is not None:
            observer.metrics.child(observer.metrics.inflight, transport).inc()
        self.span: trace.Span | None = None
        if observer.tracer is None:
            return
        carried = {str(k): v for k, v in (metadata() or ()) if isinstance(v, str)}
        # A new trace that the ratio would not sample gets no span at all: making an unsampled
        # span costs as much as the rest of the observation.
        if "traceparent" in carried or observer.sample_new():
            name, attributes = span or (
                method_path.lstrip("/"),
                {"rpc.system": "grpc", "rpc.service": self.service, "rpc.method": self.rpc},
            )
            self.span = observer.tracer.start_span(
                name,
                context=propagate.extract(carried),
                kind=SpanKind.SERVER,
                attributes={**attributes, "paddlequic.transport": transport},
            )

    def saw(self, request: Any) -> Any:
        """Take the labels from a request message (the first one of a stream)."""
        if not self.model:
            self.model = _text_field(request, "model_name", "name")
            self.version = _text_field(request, "model_version", "version")
            self.request_id = _text_field(request, "id")
        return request

    def attach(self) -> Token[OtelContext] | None:
        """Make the call's span current in this context (the caller detaches the token)."""
        if self.span is None:
            return None
        return otel_context.attach(trace.set_span_in_context(self.span))

    def current(self) -> contextlib.AbstractContextManager[None]:
        """The call's span current for a block (a call with no task: for each of its steps);
        nothing to do for a call without one."""
        return _NO_SPAN if self.span is None else self._spanned()

    @contextlib.contextmanager
    def _spanned(self) -> Iterator[None]:
        token = self.attach()
        try:
            yield
        finally:
            if token is not None:
                otel_context.detach(token)

    def abandon(self) -> None:
        """Drop the call unrecorded: another process serves it and records it (its span, never
        ended, is never exported)."""
        metrics = self.observer.metrics
        if metrics is not None:
            metrics.child(metrics.inflight, self.transport).dec()
        self.span = None

    def end(self, code: grpc.StatusCode, details: Callable[[], str], response: Any = None) -> None:
        """Record the call: `details`, the error, asked for only when its line is logged;
        `response`, the answer (its version names the one that answered)."""
        seconds = (time.perf_counter_ns() - self.started) / 1e9
        self.version = _text_field(response, "model_version") or self.version
        metrics = self.observer.metrics
        if metrics is not None:
            metrics.child(metrics.inflight, self.transport).dec()
        fields = {
            "model": self.model,
            "version": self.version,
            "transport": self.transport,
            "rpc": self.rpc,
            "request_id": self.request_id,
        }
        if self.span is not None:
            self.span.set_attribute("paddlequic.model", self.model)
            self.span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code is not grpc.StatusCode.OK:
                self.span.set_status(Status(StatusCode.ERROR, code.name))
            if self.span.is_recording():
                fields["trace_id"] = format(self.span.get_span_context().trace_id, "032x")
            self.span.end()
        self.observer.record(
            self.transport, self.rpc, self.model, self.version, code, seconds, fields, details
        )


def carried(call: Observation, metadata: Metadata) -> Metadata:
    """`metadata` for a part of the call that another process runs: its trace context
    is the call's span (none: as it came)."""
    if call.span is None:
        return metadata
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(call.span))
    kept = tuple((key, value) for key, value in metadata if key not in carrier)
    return kept + tuple(carrier.items())


@contextlib.contextmanager
def continued(metadata: Metadata) -> Iterator[None]:
    """The trace context the metadata carries made current, with no span of its own: the
    part of a call another process observes (`carried`)."""
    values = {str(key): value for key, value in metadata if isinstance(value, str)}
    if "traceparent" not in values:
        yield
        return
    token = otel_context.attach(propagate.extract(values))
    try:
        yield
    finally:
        otel_context.detach(token)


class Within:
    """A request inside a call observed as a whole (a stream's): its steps run in the call's
    span, and it is not recorded as a call of its own."""

    def __init__(self, call: Observation) -> None:
        self._call = call

    def saw(self, request: Any) -> Any:
        return request

    def current(self) -> contextlib.AbstractContextManager[None]:
        return self._call.current()

    def end(self, code: grpc.StatusCode, details: Callable[[], str], response: Any = None) -> None:
        pass


def deadline_passed(remaining: float | None, cancelled: bool) -> bool:
    """Whether a call ended by its deadline: it passed, or the call was cancelled that close to
    it. A client cancels at its own deadline, which passes a little before the server's (the
    request took time to arrive)."""
    return remaining is not None and (
        remaining <= 0 or (cancelled and remaining <= DEADLINE_MARGIN_S)
    )


def _text_field(message: Any, *names: str) -> str:
    for name in names:
        value = getattr(message, name, None)
        if isinstance(value, str) and value:
            return value
    return ""
