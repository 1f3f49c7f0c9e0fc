"""What one ModelStreamInfer stream holds for its transport, and how long its caller may leave
it there.

`Outbox`: the responses built and not yet taken by the transport, bounded in count and in
bytes (a response repeats its request's id, so a large id in every token response must not
multiply into memory): a request waits for room before it builds its next response, so the
stream holds at most `max_bytes` plus one response, whatever its requests' ids.

`StallWatch`: the caller takes no response for `stall_s` while one is waiting to be sent: it
is gone or holding the stream on purpose, and every request of the stream is cancelled (their
places and their models' batch slots free at once), one timer per stream, not one per
response."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from protos.inference import grpc_service_pb2 as pb

T = TypeVar("T")


def _uncounted() -> None:
    pass


@dataclass(frozen=True)
class StreamBounds:
    """Per stream: how long its caller may take no response, how many bytes of responses it
    holds for its caller; `on_stall`: a stream ended by the first bound, counted."""

    stall_s: float
    buffer_bytes: int
    on_stall: Callable[[], None] = _uncounted


class Outbox(Generic[T]):
    """Items for the transport in order; an item's bytes are what `size` says."""

    def __init__(self, count: int, max_bytes: int, size: Callable[[T], int]) -> None:
        self.count, self.max_bytes = count, max_bytes
        self.bytes = 0
        self._size = size
        self._items: deque[tuple[T, int]] = deque()
        self._ready: asyncio.Future[None] | None = None  # the transport's wait for an item
        self._waiters: deque[asyncio.Future[None]] = deque()  # waits for room, in order
        self._granted = False  # a waiter was given room and has not put yet

    def __len__(self) -> int:
        return len(self._items)

    def _has_room(self) -> bool:
        return len(self._items) < self.count and self.bytes < self.max_bytes

    def _free(self) -> bool:
        """Room that nobody waits for."""
        return self._has_room() and not self._waiters and not self._granted

    async def room(self) -> None:
        """Until an item may be put; the caller then puts one without awaiting in between
        (the room is its own until it does)."""
        if self._free():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._granted = False  # given the room as it left: the next waiter takes it
                self._wake()
            elif waiter in self._waiters:  # else _wake passed over it, cancelled, already
                self._waiters.remove(waiter)
            raise

    def put_now(self, item: T) -> bool:
        """Put at once if there is room nobody waits for (False: wait with `room()`)."""
        if not self._free():
            return False
        self.put(item)
        return True

    def put(self, item: T) -> None:
        """Put at once (after room(), or an end that needs none)."""
        size = self._size(item)
        self._items.append((item, size))
        self.bytes += size
        self._granted = False
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)
        self._wake()

    async def get(self) -> T:
        while not self._items:
            self._ready = asyncio.get_running_loop().create_future()
            try:
                await self._ready
            finally:
                self._ready = None
        item, size = self._items.popleft()
        self.bytes -= size
        self._wake()
        return item

    def clear(self) -> None:
        """Drop what is held (nobody will take it)."""
        self._items.clear()
        self.bytes = 0

    def _wake(self) -> None:
        """Room for one more: the oldest waiter gets it (one at a time, so that each one's
        put is counted before the next looks)."""
        while self._has_room() and self._waiters and not self._granted:
            waiter = self._waiters.popleft()
            if not waiter.cancelled():  # cancelled: its task has yet to run and leave the line
                self._granted = True
                waiter.set_result(None)


class StallWatch:
    """Calls `on_stall` once when one send has waited `stall_s` (event-loop time)."""

    def __init__(self, stall_s: float, on_stall: Callable[[], None]) -> None:
        self.stall_s = stall_s
        self.stalled = False
        self._on_stall = on_stall
        self._since: float | None = None  # when the send in progress began
        self._timer: asyncio.TimerHandle | None = None

    def sending(self) -> None:
        loop = asyncio.get_running_loop()
        self._since = loop.time()
        if self._timer is None and not self.stalled:
            self._timer = loop.call_at(self._since + self.stall_s, self._check)

    def sent(self) -> None:
        self._since = None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        if self._since is None:
            return  # idle: the next send starts the timer again
        due = self._since + self.stall_s
        loop = asyncio.get_running_loop()
        if loop.time() < due:
            self._timer = loop.call_at(due, self._check)
            return
        self.stalled = True
        self._on_stall()


def response_bytes(item: tuple[pb.ModelStreamInferResponse | None, bool] | None) -> int:
    """What an outbox item of ModelStreamInfer holds: its response's encoded size."""
    if item is None or item[0] is None:
        return 0
    return item[0].ByteSize()
