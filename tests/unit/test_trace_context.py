"""Clients carry the active trace context to the server."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from clients.trace_context import with_trace_context


def test_no_active_span_adds_nothing() -> None:
    assert with_trace_context((("x-a", "1"),)) == (("x-a", "1"),)


def test_the_active_span_travels_as_traceparent() -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("client call") as span:
        metadata = dict(with_trace_context((("x-a", "1"),)))
    context = span.get_span_context()
    assert metadata["x-a"] == "1"
    assert str(metadata["traceparent"]).startswith(
        f"00-{context.trace_id:032x}-{context.span_id:016x}-"
    )


def test_the_callers_own_traceparent_wins() -> None:
    own = (("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("other"):
        assert with_trace_context(own) == own
    assert trace.get_current_span().get_span_context().is_valid is False
