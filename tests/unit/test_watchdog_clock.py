"""The watchdog's clock (service/workers/watchdog.py) over explicit times: a batch's BLS waits
stop its wall clock and never start it again, while its worker's CPU time counts meanwhile, so
its limit is its computing alone, whatever threads it computes in; and its driver, on a virtual
clock (tests/virtual_time.py), fires when that count reaches the limit."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.workers.watchdog import (
    WAITING_LOOK_S,
    Execution,
    Watchdog,
    clocked,
    next_look,
    process_cpu_s,
)
from tests.virtual_time import VirtualTimePolicy

TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def event_loop_policy() -> asyncio.AbstractEventLoopPolicy:
    return VirtualTimePolicy()


def test_a_wait_stops_the_clock_and_the_answer_resumes_it() -> None:
    running = clocked(None, 7, False, 100.0, 1.0)
    assert running == Execution(7, 0.0, 100.0, False)
    assert next_look(running, 100.0, 1.0, TIMEOUT_S) == 120.0
    waiting = clocked(running, 7, True, 105.0, 3.0)
    assert waiting == Execution(7, 5.0, 3.0, True)
    # Blocked in exec(): its CPU time stands still, so 15 s are left whenever it is looked at.
    assert waiting.used(200.0, 3.0) == 5.0
    resumed = clocked(waiting, 7, False, 200.0, 3.0)
    assert resumed is not None
    assert next_look(resumed, 200.0, 3.0, TIMEOUT_S) == 215.0  # not 220: never from zero


def test_computing_while_a_call_is_out_counts() -> None:
    """A thread of its own spins while its call is out: 12 s of CPU in 12 s of waiting."""
    waiting = Execution(7, 5.0, 3.0, True)
    assert waiting.used(117.0, 15.0) == 17.0
    assert next_look(waiting, 117.0, 15.0, TIMEOUT_S) == 117.0 + WAITING_LOOK_S
    assert next_look(waiting, 118.0, 18.0, TIMEOUT_S) is None
    resumed = clocked(waiting, 7, False, 118.0, 16.0)
    assert resumed == Execution(7, 18.0, 118.0, False)


def test_the_next_request_starts_its_own_clock() -> None:
    used = Execution(7, 12.0, 150.0, False)
    assert clocked(used, 8, False, 160.0, 4.0) == Execution(8, 0.0, 160.0, False)
    assert clocked(used, 8, True, 160.0, 4.0) == Execution(8, 0.0, 4.0, True)
    assert clocked(used, None, False, 160.0, 4.0) is None


def test_nothing_changes_without_a_change() -> None:
    running = Execution(7, 3.0, 100.0, False)
    assert clocked(running, 7, False, 110.0, 9.0) is running
    waiting = Execution(7, 3.0, 2.0, True)
    assert clocked(waiting, 7, True, 110.0, 9.0) is waiting


steps_strategy = st.lists(
    st.tuples(
        st.floats(0.0, 50.0, allow_nan=False),  # seconds that pass
        st.floats(0.0, 1.0, allow_nan=False),  # of which the worker computed, while waiting
        st.booleans(),  # waiting afterwards
    ),
    min_size=1,
    max_size=30,
)


@given(steps_strategy)
def test_the_limit_is_the_computing_whatever_the_waits(
    steps: list[tuple[float, float, bool]],
) -> None:
    """Any pattern of runs and waits of one request: it is counted all the time it runs and
    the CPU time it uses while it waits, and a running one is looked at exactly when that
    count reaches the limit."""
    now, cpu, counted, waiting = 0.0, 0.0, 0.0, False
    execution = clocked(None, 1, waiting, now, cpu)
    for elapsed, busy, wait_next in steps:
        computed = elapsed * busy if waiting else 0.0
        counted += computed if waiting else elapsed
        now, cpu = now + elapsed, cpu + computed
        waiting = wait_next
        execution = clocked(execution, 1, waiting, now, cpu)
        assert execution is not None
        assert abs(execution.used(now, cpu) - counted) < 1e-6
        look = next_look(execution, now, cpu, TIMEOUT_S)
        if abs(counted - TIMEOUT_S) < 1e-6:
            continue  # at the limit, give or take rounding
        if counted > TIMEOUT_S:
            assert look is None
        elif not waiting:
            assert look is not None and abs(look - (now + TIMEOUT_S - counted)) < 1e-6
        else:
            assert look is not None and now < look <= now + WAITING_LOOK_S


def test_a_processs_cpu_time_is_read_and_a_gone_one_has_none() -> None:
    """What /proc says of this process is what Python counts for it (to its 10 ms ticks)."""
    spin = sum(range(2_000_000))
    before, read, after = time.process_time(), process_cpu_s(os.getpid()), time.process_time()
    assert spin and before - 0.05 <= read <= after + 0.05
    assert process_cpu_s(2**22 + 1) == 0.0  # above the largest pid Linux hands out


async def test_the_driver_fires_when_the_count_reaches_the_limit() -> None:
    """On a virtual clock: 5 s run, 100 s waiting with 3 s of CPU, then it fires 12 s after
    the answer, neither 20 (a clock started again) nor 15 (the CPU not counted)."""
    loop = asyncio.get_running_loop()
    cpu = [0.0]
    fired: list[tuple[int, float]] = []
    watchdog = Watchdog(lambda request: fired.append((request, loop.time())), lambda: cpu[0])
    started = loop.time()
    watchdog.watch(3, False, TIMEOUT_S)
    await asyncio.sleep(5)
    watchdog.watch(3, True, TIMEOUT_S)
    await asyncio.sleep(100)
    cpu[0] = 3.0
    await asyncio.sleep(1)
    assert fired == []
    watchdog.watch(3, False, TIMEOUT_S)
    await asyncio.sleep(30)
    assert fired == [(3, started + 5 + 101 + 12)]


async def test_the_driver_fires_while_the_batch_computes_during_its_wait() -> None:
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    watchdog = Watchdog(lambda _: fired.append(loop.time()), lambda: loop.time() - started)
    started = loop.time()
    watchdog.watch(3, True, TIMEOUT_S)  # waiting from the start, its CPU time as fast as time
    await asyncio.sleep(TIMEOUT_S + 2 * WAITING_LOOK_S)
    assert len(fired) == 1
    assert started + TIMEOUT_S <= fired[0] <= started + TIMEOUT_S + WAITING_LOOK_S


async def test_the_driver_never_fires_for_a_request_that_ended_or_without_a_limit() -> None:
    fired: list[int] = []
    watchdog = Watchdog(fired.append, lambda: 0.0)
    watchdog.watch(3, False, TIMEOUT_S)
    await asyncio.sleep(TIMEOUT_S - 1)
    watchdog.watch(None, False, TIMEOUT_S)  # answered in time
    await asyncio.sleep(2 * TIMEOUT_S)
    watchdog.watch(4, False, None)  # a model without a limit
    await asyncio.sleep(2 * TIMEOUT_S)
    assert fired == []
