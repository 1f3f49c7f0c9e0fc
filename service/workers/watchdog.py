"""One timer per worker on the request it is running: a worker runs its requests one after the
other, so that is the oldest one it holds, and one that has run for `execution_timeout_s` means
the worker is hung (or stopped).

What counts is the batch's own execution time. While the batch waits on its BLS calls (the
server runs those, on its own deadlines) the wall clock stops and the worker process's CPU time
counts instead: a model blocked in exec() uses none, one that computes in threads of its own
meanwhile uses it all. Once the calls are answered the wall clock goes on from there, never
from zero, so a model that keeps calling other models still ends within its limit.
`clocked` and `next_look` are the pure decisions over explicit times; `Watchdog` drives one
timer by them."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# While a batch waits, how often its worker's CPU time is read (CPU time cannot be waited for).
WAITING_LOOK_S = 0.5
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Execution:
    """The request the watchdog times and the execution time it has used."""

    request: int
    spent: float  # seconds counted before the current stretch
    since: float  # when the stretch began: loop time, or the worker's CPU time while waiting
    waiting: bool  # on its BLS calls

    def used(self, now: float, cpu: float) -> float:
        """Seconds counted so far, at loop time `now` with the worker's CPU time `cpu`."""
        return self.spent + max((cpu if self.waiting else now) - self.since, 0.0)


def clocked(
    current: Execution | None, running: int | None, waiting: bool, now: float, cpu: float
) -> Execution | None:
    """The execution timed once the worker runs `running` (None: nothing), `waiting` on BLS
    calls or not: the same request's count goes on, never starts again."""
    if running is None:
        return None
    since = cpu if waiting else now
    if current is None or current.request != running:
        return Execution(running, 0.0, since, waiting)
    if current.waiting == waiting:
        return current
    return Execution(running, current.used(now, cpu), since, waiting)


def next_look(execution: Execution, now: float, cpu: float, timeout_s: float) -> float | None:
    """When (loop time) to look at the execution again; None: it has used its `timeout_s`.
    Running, that is when it will have; waiting, a CPU count can only be looked at."""
    left = timeout_s - execution.used(now, cpu)
    if left <= 0:
        return None
    return now + (min(left, WAITING_LOOK_S) if execution.waiting else left)


def process_cpu_s(pid: int) -> float:
    """The user and system CPU seconds of a process, all its threads; 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 0.0
    fields = stat.rpartition(b")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime (fields 14, 15)


class Watchdog:
    def __init__(self, expired: Callable[[int], None], cpu: Callable[[], float]) -> None:
        self._expired = expired  # called with the request still running at its limit
        self._cpu = cpu  # the worker's CPU seconds now
        self._execution: Execution | None = None
        self._timeout_s: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, running: int | None, waiting: bool, timeout_s: float | None) -> None:
        """Time the request the worker is running now (the oldest it holds), by its CPU time
        while it waits on BLS calls."""
        loop = asyncio.get_running_loop()
        # The CPU time only where a wait begins or ends: read from /proc, not on every batch.
        was_waiting = self._execution is not None and self._execution.waiting
        cpu = self._cpu() if waiting or was_waiting else 0.0
        execution = clocked(self._execution, running, waiting, loop.time(), cpu)
        if execution == self._execution:
            return
        self._execution, self._timeout_s = execution, timeout_s
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._look()

    def _look(self) -> None:
        self._timer = None
        execution, timeout_s = self._execution, self._timeout_s
        if execution is None or timeout_s is None:
            return
        loop = asyncio.get_running_loop()
        at = next_look(execution, loop.time(), self._cpu() if execution.waiting else 0.0, timeout_s)
        if at is None:
            self._expired(execution.request)
        else:
            self._timer = loop.call_at(at, self._look)
