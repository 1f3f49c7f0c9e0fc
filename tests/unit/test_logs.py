"""Log formats: JSON lines for pipelines, readable (coloured) text on a terminal."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.observability.logs import (
    FIELD_BYTES,
    LINE_BYTES,
    MESSAGE_BYTES,
    JsonFormatter,
    LineBudget,
    RequestLog,
    TextFormatter,
    make_formatter,
    quoted,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
HINT = "using development certificates in certs\nTLS: development certificates\n  names: a, b"


@pytest.fixture
def terminal() -> Iterator[TextIO]:
    """The writing end of a real pseudo-terminal, which isatty() reports as one."""
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as stream:
        yield stream
    os.close(leader)


def record(message: str, fields: dict[str, object] | None = None) -> logging.LogRecord:
    rec = logging.LogRecord("paddlequic.server", logging.WARNING, __file__, 1, message, (), None)
    if fields is not None:
        rec.fields = fields
    return rec


def test_auto_is_text_on_a_terminal_and_json_otherwise(terminal: TextIO, tmp_path: Path) -> None:
    assert isinstance(make_formatter("auto", terminal, {}), TextFormatter)
    with (tmp_path / "log").open("w") as file:
        assert isinstance(make_formatter("auto", file, {}), JsonFormatter)
        assert isinstance(make_formatter("text", file, {}), TextFormatter)
    assert isinstance(make_formatter("json", terminal, {}), JsonFormatter)
    with pytest.raises(ValueError, match="auto, json or text"):
        make_formatter("yaml", terminal, {})


def test_colour_on_a_terminal_unless_no_color(terminal: TextIO, tmp_path: Path) -> None:
    coloured = make_formatter("auto", terminal, {}).format(record("hello"))
    assert "\x1b[33mWARNING" in coloured
    plain = make_formatter("auto", terminal, {"NO_COLOR": "1"}).format(record("hello"))
    assert "\x1b" not in plain
    with (tmp_path / "log").open("w") as file:
        assert "\x1b" not in make_formatter("text", file, {}).format(record("hello"))


def test_text_keeps_multi_line_messages_readable_and_shows_fields() -> None:
    line = TextFormatter(colour=False).format(
        record(HINT, {"event": "request", "model": "mlp", "version": "", "status": "OK"})
    )
    first, *rest = line.split("\n")
    assert first.endswith("WARNING paddlequic.server: using development certificates in certs")
    assert rest == ["    TLS: development certificates", "      names: a, b model=mlp status=OK"]


def test_json_is_unchanged_one_object_per_line() -> None:
    line = JsonFormatter().format(record(HINT, {"model": "mlp"}))
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["message"] == HINT
    assert (obj["level"], obj["logger"], obj["model"]) == ("warning", "paddlequic.server", "mlp")


def test_a_process_logs_text_to_a_terminal_and_json_to_a_pipe() -> None:
    """configure_logging picks the format from the real stderr the process was given."""
    code = (
        "import logging, sys; from service.observability.logs import configure_logging;"
        "configure_logging('auto', 'info'); logging.getLogger('paddlequic.x').info('a\\nb')"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "NO_COLOR": ""}
    piped = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(piped.stderr)["message"] == "a\nb"
    leader, follower = os.openpty()
    try:
        subprocess.run([sys.executable, "-c", code], env=env, stderr=follower, check=True)
        written = os.read(leader, 4096).decode().replace("\r\n", "\n")
    finally:
        os.close(follower)
        os.close(leader)
    lines = written.splitlines()
    assert "\x1b[32mINFO" in lines[0] and lines[0].endswith("paddlequic.x: a")
    assert lines[1:] == ["    b"]


class FakeClock:
    """Time that moves only when the test moves it (the budget's injected clock)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@settings(derandomize=True, max_examples=50, deadline=None)
@given(
    burst=st.integers(1, 10),
    per_second=st.floats(0.1, 10.0),
    gaps=st.lists(st.floats(0.0, 2.0), max_size=60),
)
def test_the_failure_budget_logs_a_burst_then_its_rate_and_counts_what_it_left_out(
    burst: int, per_second: float, gaps: list[float]
) -> None:
    clock = FakeClock()
    budget = LineBudget(burst, per_second, clock)
    logged, reported, offered = 0, 0, 0
    for gap in gaps:
        clock.now += gap
        offered += 1
        left_out = budget.admit("key")
        if left_out is not None:
            logged += 1
            reported += left_out
    assert logged <= burst + clock.now * per_second
    # Every line left out is reported by a later line, except those after the last one.
    assert reported <= offered - logged
    assert budget.admit("another key") == 0  # keys have budgets of their own


def test_the_failure_budget_reports_the_lines_it_left_out_with_the_next_one() -> None:
    clock = FakeClock()
    budget = LineBudget(2, 1.0, clock)
    assert [budget.admit("k") for _ in range(5)] == [0, 0, None, None, None]
    clock.now += 1.0
    assert budget.admit("k") == 3
    assert budget.admit("k") is None


def test_the_request_log_leaves_failures_out_past_the_budget_and_says_how_many(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    log = RequestLog(
        slow_ms=1000.0, sample_ratio=0.0, seed=None, failures=LineBudget(1, 1.0, clock)
    )
    fields = {"transport": "h3", "rpc": "ModelInfer", "model": "", "version": ""}
    with caplog.at_level(logging.INFO, logger="paddlequic.requests"):
        for _ in range(4):
            log.emit(grpc.StatusCode.INVALID_ARGUMENT, 1.0, dict(fields))
        log.emit(grpc.StatusCode.OK, 1.0, dict(fields))  # successes are not budgeted
        clock.now += 1.0
        log.emit(grpc.StatusCode.INVALID_ARGUMENT, 1.0, dict(fields))
    logged = [r.__dict__["fields"] for r in caplog.records]
    assert [(f["status"], f.get("left_out")) for f in logged] == [
        ("INVALID_ARGUMENT", None),
        ("OK", None),
        ("INVALID_ARGUMENT", 3),
    ]


@settings(derandomize=True, max_examples=200, deadline=None)
@given(text=st.text(max_size=3000), limit=st.integers(16, 2048))
def test_a_quote_is_bounded_in_bytes_and_whole_when_it_fits(text: str, limit: int) -> None:
    shown = quoted(text, limit)
    if len(text.encode()) <= limit:
        assert shown == text
    else:
        head, _, rest = shown.rpartition("... (")
        assert len(head.encode()) <= limit and text.startswith(head)
        assert rest == f"{len(text)} characters)"


@pytest.mark.parametrize("formatter", [JsonFormatter(), TextFormatter(colour=False)])
def test_a_flood_of_failures_quoting_a_huge_id_costs_kilobytes(
    formatter: logging.Formatter,
) -> None:
    """The measured flood: 366 failing calls with a 4 MiB id in 10 s grew the log by
    116 MiB. Each line now quotes a bounded part of it, and big lines cost more budget."""
    clock = FakeClock()
    log = RequestLog(1000.0, 0.0, None, LineBudget(20, 1.0, clock))
    written: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: written.append(formatter.format(record))  # type: ignore[method-assign]
    logger = logging.getLogger("paddlequic.requests")
    logger.addHandler(handler)
    try:
        huge = "i" * (4 << 20)
        for call in range(366):
            clock.now = call * 10 / 366
            fields = {"transport": "h2", "rpc": "ModelInfer", "model": huge, "request_id": huge}
            log.emit(grpc.StatusCode.INVALID_ARGUMENT, 1.0, {**fields, "error": huge})
    finally:
        logger.removeHandler(handler)
    assert written
    assert all(len(line.encode()) < 5 * FIELD_BYTES + MESSAGE_BYTES for line in written)
    # 20 lines of burst plus one a second, each costing its size in LINE_BYTES
    assert sum(len(line.encode()) for line in written) < (20 + 10) * 2 * LINE_BYTES


def test_a_log_message_is_bounded_too() -> None:
    line = json.loads(JsonFormatter().format(record("x" * (1 << 20), {"model": "m" * 5000})))
    assert len(line["message"].encode()) < MESSAGE_BYTES + 64
    assert len(line["model"].encode()) < FIELD_BYTES + 64
