"""Every request at least `--slow-request-ms` slow is logged, sampled or not
(docs/operations.md, "Logged are every failed request, every request slower than
`--slow-request-ms`"): a finished call goes through the Observer the server builds, with its
duration given, so nothing waits for a slow request."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service import settings as server_settings
from service.observability.logs import REQUEST_LOG, LineBudget, RequestLog
from service.observability.observer import Observer

PROFILE = settings(max_examples=40, deadline=None, derandomize=True, database=None)


class Lines(logging.Handler):
    """The request log's records, as the server's log handler would receive them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def lines() -> Iterator[Lines]:
    handler = Lines()
    level = REQUEST_LOG.level
    REQUEST_LOG.addHandler(handler)
    REQUEST_LOG.setLevel(logging.INFO)
    yield handler
    REQUEST_LOG.removeHandler(handler)
    REQUEST_LOG.setLevel(level)


def finish(slow_ms: float, seconds: float, lines: Lines) -> list[logging.LogRecord]:
    """One successful ModelInfer that took `seconds`, unsampled (ratio 0): what it logged."""
    observer = Observer(None, RequestLog(slow_ms, 0.0, None, LineBudget(20, 1.0)), None)
    lines.records.clear()
    fields = {"model": "mlp", "version": "1", "transport": "h2", "rpc": "ModelInfer"}
    observer.record("h2", "ModelInfer", "mlp", "1", grpc.StatusCode.OK, seconds, fields, lambda: "")
    return list(lines.records)


@PROFILE
@given(slow_ms=st.floats(0, 1e6), over_ms=st.floats(0, 1e6))
def test_a_request_at_least_that_slow_is_logged(
    lines: Lines, slow_ms: float, over_ms: float
) -> None:
    seconds = (slow_ms + over_ms) / 1e3 + 1e-3  # a millisecond over: rounding cannot hide it
    (logged,) = finish(slow_ms, seconds, lines)
    assert logged.levelno == logging.INFO
    fields = logged.__dict__["fields"]
    assert (fields["status"], fields["model"], fields["rpc"]) == ("OK", "mlp", "ModelInfer")
    assert fields["latency_ms"] >= slow_ms


@PROFILE
@given(slow_ms=st.floats(2, 1e6), under=st.floats(0, 0.99))
def test_a_faster_unsampled_request_is_not_logged(
    lines: Lines, slow_ms: float, under: float
) -> None:
    assert finish(slow_ms, slow_ms * under / 1e3, lines) == []


def test_the_default_threshold_is_one_second(lines: Lines) -> None:
    slow_ms = server_settings.parse([]).slow_request_ms
    assert slow_ms == 1000.0
    assert len(finish(slow_ms, 1.0, lines)) == 1
    assert finish(slow_ms, 0.999, lines) == []
