"""One timer per worker on the request it is running: a worker runs its requests one after the
other, so that is the oldest one it holds, and one that has run for `execution_timeout_s` means
the worker is hung (or stopped).

What counts is the batch's own execution time: its clock stops while the batch waits on its BLS
calls (the server runs those, on its own deadlines) and goes on from where it stopped once they
are answered, so a model that keeps calling other models still ends within its limit.
`clocked` is the pure decision over explicit times; `Watchdog` drives one timer by it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Execution:
    """The request the watchdog times and the execution time it has used."""

    request: int
    spent: float  # seconds it ran before `since`
    since: float | None  # when it last went on running; None while it waits on BLS calls

    def expires_at(self, timeout_s: float) -> float | None:
        """When it will have run `timeout_s`, if it runs on; None while it waits."""
        return None if self.since is None else self.since + timeout_s - self.spent


def clocked(
    current: Execution | None, running: int | None, waiting: bool, now: float
) -> Execution | None:
    """The execution timed once the worker runs `running` (None: nothing), `waiting` on BLS
    calls or not: the same request's clock stops and goes on, never starts again."""
    if running is None:
        return None
    if current is None or current.request != running:
        return Execution(running, 0.0, None if waiting else now)
    if waiting and current.since is not None:
        return Execution(running, current.spent + now - current.since, None)
    if not waiting and current.since is None:
        return Execution(running, current.spent, now)
    return current


class Watchdog:
    def __init__(self, expired: Callable[[int], None]) -> None:
        self._expired = expired  # called with the request still running at its limit
        self._execution: Execution | None = None
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, running: int | None, waiting: bool, timeout_s: float | None) -> None:
        """Time the request the worker is running now (the oldest it holds), stopped while it
        waits on BLS calls."""
        loop = asyncio.get_running_loop()
        execution = clocked(self._execution, running, waiting, loop.time())
        if execution == self._execution:
            return
        self._execution = execution
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if execution is None or timeout_s is None:
            return
        expires = execution.expires_at(timeout_s)
        if expires is not None:
            self._timer = loop.call_at(expires, self._expire, execution.request)

    def _expire(self, request_id: int) -> None:
        self._timer = None
        self._expired(request_id)
