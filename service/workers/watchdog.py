"""One timer per worker on the request it is running: a worker runs its requests one after the
other, so that is the oldest one it holds, and one still running after `execution_timeout_s`
means the worker is hung (or stopped)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Watchdog:
    def __init__(self, expired: Callable[[int], None]) -> None:
        self._expired = expired  # called with the request still running at its limit
        self._watched: int | None = None  # the request the watchdog times
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, oldest: int | None, timeout_s: float | None) -> None:
        """Time the request the worker is running now: the oldest it holds."""
        if oldest == self._watched:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._watched = oldest
        if oldest is not None and timeout_s is not None:
            self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, oldest)

    def _expire(self, request_id: int) -> None:
        self._timer = None
        self._expired(request_id)
