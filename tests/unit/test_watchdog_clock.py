"""The watchdog's clock (service/workers/watchdog.py) over explicit times: a batch's BLS waits
stop its clock and never start it again, so its limit is execution time alone; and its driver,
on a virtual clock (tests/virtual_time.py), fires when the time run reaches the limit."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.workers.watchdog import Execution, Watchdog, clocked
from tests.virtual_time import VirtualTimePolicy

TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def event_loop_policy() -> asyncio.AbstractEventLoopPolicy:
    return VirtualTimePolicy()


def test_a_wait_stops_the_clock_and_the_answer_resumes_it() -> None:
    running = clocked(None, 7, False, 100.0)
    assert running == Execution(7, 0.0, 100.0)
    assert running.expires_at(TIMEOUT_S) == 120.0
    waiting = clocked(running, 7, True, 105.0)
    assert waiting == Execution(7, 5.0, None)
    assert waiting.expires_at(TIMEOUT_S) is None
    resumed = clocked(waiting, 7, False, 200.0)
    # 5 s used before the call: 15 s left, not 20 from the answer.
    assert resumed is not None and resumed.expires_at(TIMEOUT_S) == 215.0


def test_the_next_request_starts_its_own_clock() -> None:
    used = Execution(7, 12.0, 150.0)
    assert clocked(used, 8, False, 160.0) == Execution(8, 0.0, 160.0)
    assert clocked(used, 8, True, 160.0) == Execution(8, 0.0, None)
    assert clocked(used, None, False, 160.0) is None


def test_nothing_changes_without_a_change() -> None:
    running = Execution(7, 3.0, 100.0)
    assert clocked(running, 7, False, 110.0) is running
    waiting = Execution(7, 3.0, None)
    assert clocked(waiting, 7, True, 110.0) is waiting


@given(
    st.lists(
        st.tuples(st.floats(0.0, 50.0, allow_nan=False), st.booleans()), min_size=1, max_size=30
    )
)
def test_the_limit_is_the_time_run_whatever_the_waits(steps: list[tuple[float, bool]]) -> None:
    """Any pattern of runs and waits of one request: while it runs it expires when the time it
    ran (outside its waits) reaches the limit."""
    now, ran, waiting = 0.0, 0.0, False
    execution = clocked(None, 1, waiting, now)
    for elapsed, wait_next in steps:
        if not waiting:
            ran += elapsed
        now += elapsed
        waiting = wait_next
        execution = clocked(execution, 1, waiting, now)
        assert execution is not None
        expires = execution.expires_at(TIMEOUT_S)
        if waiting:
            assert expires is None
            assert abs(execution.spent - ran) < 1e-6
        else:
            assert expires is not None
            assert abs(expires - (now + TIMEOUT_S - ran)) < 1e-6


async def test_the_driver_fires_when_the_time_run_reaches_the_limit() -> None:
    """On a virtual clock: 5 s run, 100 s waiting (nothing fires), then it fires 15 s after
    the answer, not 20."""
    loop = asyncio.get_running_loop()
    fired: list[tuple[int, float]] = []
    watchdog = Watchdog(lambda request: fired.append((request, loop.time())))
    started = loop.time()
    watchdog.watch(3, False, TIMEOUT_S)
    await asyncio.sleep(5)
    watchdog.watch(3, True, TIMEOUT_S)
    await asyncio.sleep(100)
    assert fired == []
    watchdog.watch(3, False, TIMEOUT_S)
    await asyncio.sleep(30)
    assert fired == [(3, started + 5 + 100 + 15)]
