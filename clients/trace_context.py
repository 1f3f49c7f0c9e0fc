"""Carry the caller's current OpenTelemetry trace context to the server (W3C `traceparent` in
the call metadata), so one request can be followed across services."""

from __future__ import annotations

from collections.abc import Iterable

Metadata = tuple[tuple[str, str | bytes], ...]


def with_trace_context(metadata: Iterable[tuple[str, str | bytes]] = ()) -> Metadata:
    """The metadata plus `traceparent` (and `tracestate`) of the active span, if there is one
    and the caller did not set its own."""
    pairs = tuple(metadata)
    if any(key == "traceparent" for key, _ in pairs):
        return pairs
    try:
        from opentelemetry import propagate
    except ImportError:  # tracing is optional for clients
        return pairs
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return pairs + tuple(carrier.items())
