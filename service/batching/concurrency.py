"""How many requests of one version run at once, for requests that hold their place for long (a
decoupled model's generations, which never share a batch): at most `limit` run, at most
`queued` more wait, and beyond that a request is refused at once.

Places are shared fairly between clients (a client: whoever a caller key names, the peer's
address or its certificate's identity, service/api/callers.py): a place that frees while
others wait goes to the waiting client that holds the fewest places, its oldest request first
(arrival order between clients that hold as many). So while others wait, a client that holds
more than its share gains no place, and its share falls to an even one as its requests end.
A newcomer runs at once only if a place is free and nobody waits. The waiting line is shared
the same way: when it is full, a newcomer whose client would still have fewer requests
waiting than the client with the most takes the place of that client's newest waiter (which
is refused), so no client can fill the line to keep the others out.

`WaitLine` decides (pure, like queue.py's BatchQueue); `ConcurrencyLimit` is its asyncio
driver, whose waiters leave the line the moment their caller goes away or their deadline
passes."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Hashable
from typing import Generic, TypeVar

import grpc

from service.inference import errors
from service.inference.timers import fail_at

T = TypeVar("T", bound=Hashable)
Client = Hashable  # who a request belongs to, for the fair share of places


class LineFull(Exception):
    pass


class WaitLine(Generic[T]):
    def __init__(self, limit: int, queued: int) -> None:
        self.limit = limit
        self.queued_limit = queued
        self.running = 0
        self.held: Counter[Client] = Counter()  # places each client holds
        self._waiting: dict[T, Client] = {}  # insertion order: arrival order

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def arrive(self, ticket: T, client: Client) -> tuple[bool, T | None]:
        """Whether it runs now (else it waits for finish() to name it), and the waiter it
        displaced from a full line, if any. LineFull: refused."""
        if self.running < self.limit and not self._waiting:
            self._start(client)
            return True, None
        displaced = None
        if len(self._waiting) >= self.queued_limit:
            waiting = Counter(self._waiting.values())
            most, count = max(waiting.items(), key=lambda item: item[1], default=(None, 0))
            if waiting[client] + 1 >= count:
                raise LineFull
            displaced = next(t for t in reversed(self._waiting) if self._waiting[t] == most)
            del self._waiting[displaced]
        self._waiting[ticket] = client
        return False, displaced

    def leave(self, ticket: T) -> None:
        """A waiter gave up (cancelled, deadline): it no longer holds a place in the line."""
        self._waiting.pop(ticket, None)

    def finish(self, client: Client) -> tuple[T, Client] | None:
        """A running request of `client` ended: the waiter that runs in its place and its
        client, if any (the oldest of the waiting client that holds the fewest places)."""
        self._end(client)
        if not self._waiting:
            return None
        fewest = min(self.held[waiter] for waiter in self._waiting.values())
        ticket, chosen = next(
            (ticket, waiter)
            for ticket, waiter in self._waiting.items()
            if self.held[waiter] == fewest
        )
        del self._waiting[ticket]
        self._start(chosen)
        return ticket, chosen

    def _start(self, client: Client) -> None:
        self.running += 1
        self.held[client] += 1

    def _end(self, client: Client) -> None:
        self.running -= 1
        self.held[client] -= 1
        if not self.held[client]:
            del self.held[client]


class ConcurrencyLimit:
    def __init__(self, limit: int, queued: int, name: str) -> None:
        self._line: WaitLine[asyncio.Future[None]] = WaitLine(limit, queued)
        self._name = name
        # With --frontends N: what front-ends said they hold in places of their own (waiting,
        # running), shown with this process's (ListInstances; a version winds down after).
        self.elsewhere = (0, 0)

    @property
    def queued(self) -> int:
        return self._line.waiting + self.elsewhere[0]

    @property
    def in_flight_requests(self) -> int:
        return self._line.running + self.elsewhere[1]

    @contextlib.asynccontextmanager
    async def held(self, deadline: float | None, client: Client) -> AsyncIterator[None]:
        """A place among the running requests, for `client`, for the duration of the block."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            runs, displaced = self._line.arrive(future, client)
        except LineFull:
            line = self._line
            raise errors.ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._name} runs at most {line.limit} requests at once (parameter "
                f"max_concurrent_requests) and holds at most {line.queued_limit} waiting "
                "(parameter max_queued_requests); retry later",
            ) from None
        if displaced is not None and not displaced.done():
            displaced.set_exception(
                errors.ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self._name} holds at most {self._line.queued_limit} requests waiting "
                    "(parameter max_queued_requests), shared between clients: this one gave "
                    "its place to a client with fewer waiting; retry later",
                )
            )
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
                    self._finish(client)  # given the place just as its caller left: pass it on
                else:
                    self._line.leave(future)
                raise
            finally:
                if timer is not None:
                    timer.cancel()
        try:
            yield
        finally:
            self._finish(client)

    def _finish(self, client: Client) -> None:
        """The place goes to the waiter the line names that is still waiting (one whose
        deadline just failed it has not left yet), or back to the line."""
        while (following := self._line.finish(client)) is not None:
            future, client = following
            if not future.done():
                future.set_result(None)
                return
