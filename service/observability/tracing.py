"""OpenTelemetry set-up: off unless --trace-console or --otlp-endpoint asks for spans."""

from __future__ import annotations

import importlib
import os
import sys

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

SERVICE_NAME = "paddlequic"


class TracingUnavailable(Exception):
    """--otlp-endpoint was given but the `otlp` extra is not installed."""


def tracer_provider(
    console: bool, otlp_endpoint: str, sample_ratio: float
) -> TracerProvider | None:
    """A provider of our own (not the global one, which a library could replace), or None
    when tracing is off. New traces are sampled at `sample_ratio`; continued ones follow the
    caller's decision."""
    if not console and not otlp_endpoint:
        return None
    provider = TracerProvider(
        resource=Resource.create({"service.name": SERVICE_NAME}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
    )
    if console:
        # One span per line on stderr, beside the JSON logs; written at once (debugging aid).
        exporter = ConsoleSpanExporter(out=sys.stderr, formatter=_one_line)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if otlp_endpoint:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(otlp_endpoint)))
    return provider


def _one_line(span: ReadableSpan) -> str:
    line: str = span.to_json(indent=None)
    return line + os.linesep


def _otlp_exporter(endpoint: str) -> SpanExporter:
    try:
        module = importlib.import_module("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
    except ImportError:
        raise TracingUnavailable(
            "--otlp-endpoint needs the OTLP exporter: pip install 'paddlequic[otlp]'"
        ) from None
    exporter: SpanExporter = module.OTLPSpanExporter(endpoint=endpoint)
    return exporter
