"""A Paddle worker that takes its requests straight from the processes holding the calls (the
server, and each front-end with --frontends N: its producers), batching them itself
(`QueuedWorker`, queued_worker.py) and waking each caller's process once per batch, not once
per request.

It sleeps in poll() on its producers' wake-up descriptors and its message socket until a
request comes or the queue's next decision is due (the oldest request's batching window, a
queue timeout): an idle worker uses no CPU."""

from __future__ import annotations

import math
import mmap
import os
import select
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

from service.queues import wakeups
from service.queues.layout import QueueLayout
from service.workers import protocol
from service.workers.queued_worker import QueuedWorker

# A caller reads its replies as they come: only a burst, or a caller held still, fills its ring.
# Its answers then wait in the worker (at most one per request it has out, which its queue
# bound limits) while the worker serves its other callers, and go in as the caller reads.
FULL_REPLIES_WAIT_S = 0.001
PARENT = 0  # the producer the first Queues message brings: the server's process


class Inbox(Protocol):
    """Where the server's messages come from: readable when some can be taken."""

    def fileno(self) -> int: ...

    def take(self) -> list[protocol.Message | None]:
        """The messages there are (None: the server closed the socket)."""
        ...


class SocketInbox:
    """The server's socket itself (a Paddle worker's: nothing else reads it)."""

    def __init__(self, sock: socket.socket, recv: Callable[[], protocol.Message | None]):
        self._sock = sock
        self._recv = recv

    def fileno(self) -> int:
        return self._sock.fileno()

    def take(self) -> list[protocol.Message | None]:
        return [self._recv()]


def serve_queued(
    model: Any,
    setup: protocol.Queues,
    inbox: Inbox,
    channel: socket.socket,
    reason: Callable[[BaseException], str],
    testing: tuple[float | None, float | None],
) -> int:
    """Serve from the producers' rings until Shutdown or the server's socket closes."""
    worker = QueuedWorker(model, setup, reason, testing)
    poller = select.poll()
    messages = inbox.fileno()
    poller.register(messages, select.POLLIN)
    watched: set[int] = set()
    if not _add(worker, setup.layout, PARENT, channel):
        return 2
    while True:
        worker.take()
        worker.publish()
        look = worker.step()
        waiting = worker.flush()
        worker.tell()
        if look == 0.0:
            continue
        if waiting:  # a caller's ring is full: look again soon (its caller reads it)
            soon = time.monotonic() + FULL_REPLIES_WAIT_S
            look = soon if look is None else min(look, soon)
        watched = _watch(poller, watched, {p.wake_in for p in worker.producers.values()})
        timeout = -1 if look is None else max(0, math.ceil((look - time.monotonic()) * 1000))
        for fd, _ in poller.poll(timeout):
            if fd != messages:
                wakeups.clear(fd)
                continue
            for msg in inbox.take():
                if isinstance(msg, protocol.AddProducer):
                    if not _add(worker, setup.layout, msg.producer, channel):
                        return 2
                elif isinstance(msg, protocol.DropProducer):
                    worker.drop(msg.producer)
                elif msg is None or isinstance(msg, protocol.Shutdown):
                    if isinstance(msg, protocol.Shutdown) and hasattr(model, "finalize"):
                        model.finalize()
                    return 0


def _add(worker: QueuedWorker, layout: QueueLayout, key: int, channel: socket.socket) -> bool:
    """A producer's segment and wake-ups, from the segments channel (False: they did not
    come as the server sends them)."""
    _, fds, _, _ = socket.recv_fds(channel, 256, 3)
    if len(fds) != 3:
        return False
    segment_fd, wake_in, wake_out = fds
    try:
        segment = mmap.mmap(segment_fd, layout.size)
    finally:
        os.close(segment_fd)
    worker.add(key, segment, wake_in, wake_out)
    return True


def _watch(poller: select.poll, watched: set[int], wanted: set[int]) -> set[int]:
    """Poll the wake-ups of the producers there are now (one dropped has its closed)."""
    for fd in watched - wanted:
        poller.unregister(fd)
    for fd in wanted - watched:
        poller.register(fd, select.POLLIN)
    return wanted
