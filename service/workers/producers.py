"""One process holding calls (the server, or a front-end with --frontends N), as a worker
batching from its own queues sees it: its segment's worker end (request ring, reply ring,
running area), its wake-ups, and the answers that wait while its reply ring is full."""

from __future__ import annotations

import collections
import mmap
import os
from collections.abc import Callable

from service.queues import wakeups
from service.queues.layout import QueueLayout


class Producer:
    """One process holding calls, as the worker sees it: its segment's worker end."""

    def __init__(self, layout: QueueLayout, segment: mmap.mmap, wake_in: int, wake_out: int):
        self.segment = segment
        self.requests, self.replies, self.running = layout.worker_end(memoryview(segment))
        self.wake_in = wake_in
        self.wake_out = wake_out
        self.written = 0  # replies so far: it is woken once for those of a step
        self.told = 0
        self.backlog: collections.deque[bytearray] = collections.deque()  # its full ring's
        self._others = 0  # what its running area last said of the others' requests held

    def others_held(self, count: int) -> None:
        """How many requests of the other producers the worker holds (written on a change:
        the caller reads the line it is on whenever it chooses an instance)."""
        if count != self._others:
            self._others = count
            self.running.others_held(count)

    def reply(self, size: int, write: Callable[[memoryview], object]) -> None:
        """An answer of `size` bytes (`write` fills it) into the reply ring, or, while the
        ring is full or answers wait before it, into the backlog."""
        if not self.backlog:
            buf = self.replies.reserve(size)
            if buf is not None:
                write(buf)
                buf.release()
                self.replies.commit()
                self.written += 1
                return
        held = bytearray(size)
        with memoryview(held) as view:
            write(view)
        self.backlog.append(held)

    def flush(self) -> bool:
        """Waiting answers into the ring while it has room; whether some still wait."""
        while self.backlog:
            buf = self.replies.reserve(len(self.backlog[0]))
            if buf is None:
                return True
            buf[:] = self.backlog.popleft()
            buf.release()
            self.replies.commit()
            self.written += 1
        return False

    def tell(self) -> None:
        if self.written != self.told:
            self.told = self.written
            wakeups.wake(self.wake_out)

    def close(self) -> None:
        for end in (self.requests, self.replies, self.running):
            end.release()
        self.segment.close()
        os.close(self.wake_in)
        os.close(self.wake_out)
