"""The asyncio scaffolding a batcher drives its queue's decisions with: one scheduler task
that sleeps until a given time or until something changes, and the batch tasks it starts,
all ended by stop(). Shared by the dynamic and the sequence batcher."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

from service.inference.timers import wake_at


class SchedulerLoop:
    def __init__(self, schedule: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._schedule = schedule
        self._task: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[None] | None = None  # the scheduler's, while it sleeps
        self.sleep_until: float | None = None  # when the sleeping scheduler looks again anyway
        self._batches: set[asyncio.Task[None]] = set()

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._schedule())

    def wake(self) -> None:
        """Something changed (a request came, a batch ended): the scheduler looks again,
        started first if it is not running."""
        self.ensure_running()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def sleep(self, until: float | None) -> None:
        """Until `until` (event-loop time; None: no limit) or the next wake()."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiter, self.sleep_until = waiter, until
        timer = wake_at(waiter, until)
        try:
            await waiter
        finally:
            self._waiter = self.sleep_until = None
            if timer is not None:
                timer.cancel()

    def start(self, batch: Coroutine[Any, Any, None]) -> None:
        """Run a batch; stop() waits for it."""
        task = asyncio.get_running_loop().create_task(batch)
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def stop(self) -> None:
        """The scheduler ends; the batches it started finish."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._batches):
            await asyncio.wait({task})
