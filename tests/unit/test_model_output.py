"""A Python model's prints in the log (service/workers/model_output.py): the budget's
decisions with explicit time, and the reader thread on a real pipe."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.workers.model_output import (
    BURST_S,
    MAX_LOG_LINE,
    ModelOutput,
    OutputBudget,
    OutputReader,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


rates = st.floats(min_value=0.0, max_value=1000.0)
arrivals = st.lists(
    st.tuples(st.floats(min_value=0.0, max_value=5.0), st.integers(0, 8192)), max_size=400
)


@given(rates, st.floats(min_value=0.0, max_value=1e6), arrivals)
def test_what_is_logged_stays_within_the_budget_and_the_rest_is_counted(
    lines_per_s: float, bytes_per_s: float, lines: list[tuple[float, int]]
) -> None:
    clock = Clock()
    budget = OutputBudget(lines_per_s, bytes_per_s, clock)
    admitted = admitted_bytes = reported = 0
    for wait, nbytes in lines:
        clock.now += wait
        verdict = budget.admit(nbytes)
        if verdict is not None:
            admitted += 1
            admitted_bytes += nbytes + 1
            reported += verdict
    elapsed = clock.now - 1000.0
    assert admitted <= lines_per_s * (BURST_S + elapsed) + 1e-6
    assert admitted_bytes <= bytes_per_s * (BURST_S + elapsed) + 1e-6
    assert admitted + budget.dropped == len(lines)
    # Every line dropped is reported once: before a later line logged, or at the end.
    assert reported + budget.take_unreported() == budget.dropped
    assert budget.take_unreported() == 0


@given(st.floats(min_value=1.0, max_value=1000.0), st.integers(1, 400))
def test_a_model_within_its_rate_loses_nothing(lines_per_s: float, count: int) -> None:
    clock = Clock()
    line = 80
    budget = OutputBudget(lines_per_s, lines_per_s * (line + 1), clock)
    for _ in range(count):
        clock.now += 1.0 / lines_per_s
        assert budget.admit(line) == 0
    assert budget.dropped == 0


def test_a_flood_keeps_burst_then_the_rate() -> None:
    clock = Clock()
    budget = OutputBudget(10.0, 1e9, clock)
    verdicts = [budget.admit(0) for _ in range(1000)]
    assert sum(v is not None for v in verdicts) == 10 * BURST_S
    clock.now += 0.5
    assert [budget.admit(0) for _ in range(10)] == [900, 0, 0, 0, 0, None, None, None, None, None]
    assert budget.dropped == 905


def test_the_reader_logs_lines_within_the_budget_off_the_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two lines fit; the flood after them is dropped and said so once the pipe ends; a line
    longer than MAX_LOG_LINE is cut, its rest never logged as a line of its own."""

    async def run() -> ModelOutput:
        output = ModelOutput("m", OutputBudget(2 / BURST_S, 1e9))
        read, write = os.pipe()
        reader = OutputReader(read, output)
        long = "é" * (3 * MAX_LOG_LINE)  # more bytes than a line may hold: cut
        os.write(write, f"{long}\nsecond\n".encode() + b"\n" * 5000 + b"unfinished")
        os.close(write)
        await asyncio.wait_for(reader.done, 30)
        return output

    with caplog.at_level(logging.INFO, logger="paddlequic.model"):
        output = asyncio.run(run())
    messages = [r.getMessage() for r in caplog.records if r.name == "paddlequic.model"]
    assert messages[0] == "model m: " + "é" * MAX_LOG_LINE
    assert messages[1] == "model m: second"
    assert messages[2].startswith("model m: 5001 line(s) of its output dropped, over its budget")
    assert len(messages) == 3
    assert output.dropped == 5001


def test_stop_ends_a_reader_whose_pipe_stays_open(caplog: pytest.LogCaptureFixture) -> None:
    """Something the worker started may hold its pipe open: the server still stops, and what
    was read is logged; stopping again after the end does nothing."""

    async def run() -> None:
        read, write = os.pipe()
        reader = OutputReader(read, ModelOutput("m", OutputBudget()))
        os.write(write, b"before the stop\n")
        while not any("before the stop" in r.getMessage() for r in caplog.records):
            await asyncio.sleep(0.01)
        reader.stop()
        await asyncio.wait_for(reader.done, 30)
        reader.stop()
        os.close(write)

    with caplog.at_level(logging.INFO, logger="paddlequic.model"):
        asyncio.run(asyncio.wait_for(run(), 60))
