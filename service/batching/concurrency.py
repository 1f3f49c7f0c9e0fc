"""How many requests of one version run at once, for requests that hold their place for long (a
decoupled model's generations, which never share a batch): at most `limit` run, at most
`queued` more wait in arrival order, and beyond that a request is refused at once.

`WaitLine` decides (pure, like queue.py's BatchQueue); `ConcurrencyLimit` is its asyncio
driver, whose waiters leave the line the moment their caller goes away or their deadline
passes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable
from typing import Generic, TypeVar

import grpc

from service.inference import errors
from service.inference.timers import fail_at

T = TypeVar("T", bound=Hashable)


class LineFull(Exception):
    pass


class WaitLine(Generic[T]):
    def __init__(self, limit: int, queued: int) -> None:
        self.limit = limit
        self.queued_limit = queued
        self.running = 0
        self._waiting: dict[T, None] = {}  # insertion order: arrival order

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def arrive(self, ticket: T) -> bool:
        """True: it runs now; False: it waits for finish() to name it. LineFull: refused."""
        if self.running < self.limit and not self._waiting:
            self.running += 1
            return True
        if len(self._waiting) >= self.queued_limit:
            raise LineFull
        self._waiting[ticket] = None
        return False

    def leave(self, ticket: T) -> None:
        """A waiter gave up (cancelled, deadline): it no longer holds a place in the line."""
        self._waiting.pop(ticket, None)

    def finish(self) -> T | None:
        """A running request ended: the waiter that runs in its place, if any."""
        for ticket in self._waiting:
            del self._waiting[ticket]
            return ticket
        self.running -= 1
        return None


class ConcurrencyLimit:
    def __init__(self, limit: int, queued: int, name: str) -> None:
        self._line: WaitLine[asyncio.Future[None]] = WaitLine(limit, queued)
        self._name = name

    @property
    def queued(self) -> int:
        return self._line.waiting

    @property
    def in_flight_requests(self) -> int:
        return self._line.running

    @contextlib.asynccontextmanager
    async def held(self, deadline: float | None) -> AsyncIterator[None]:
        """A place among the running requests for the duration of the block."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            runs = self._line.arrive(future)
        except LineFull:
            line = self._line
            raise errors.ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._name} runs at most {line.limit} requests at once (parameter "
                f"max_concurrent_requests) and holds at most {line.queued_limit} waiting "
                "(parameter max_queued_requests); retry later",
            ) from None
        if not runs:
            timer = fail_at(
                future,
                deadline,
                lambda: errors.deadline_exceeded(
                    f"the request's deadline passed while it waited for one of the "
                    f"{self._line.limit} places of {self._name}"
                ),
            )
            try:
                await future
            except BaseException:
                if future.done() and not future.cancelled() and future.exception() is None:
                    self._finish()  # given the place just as its caller left: pass it on
                else:
                    self._line.leave(future)
                raise
            finally:
                if timer is not None:
                    timer.cancel()
        try:
            yield
        finally:
            self._finish()

    def _finish(self) -> None:
        """The place goes to the first waiter still waiting (one whose deadline just failed
        it has not left yet), or back to the line."""
        while (following := self._line.finish()) is not None:
            if not following.done():
                following.set_result(None)
                return
