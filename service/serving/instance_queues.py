"""The process holding the calls: its end of one worker's queues (service/queues/). It writes
requests into the worker's request ring and wakes the worker once per event-loop turn, however
many it wrote; it reads every answer the worker wrote when woken (once per batch), each
checked as hostile input; and it keeps every request it wrote until the answer comes, so when
the worker dies it still has them to send again.

Its watchdog reads the running area while requests are out: a batch number that stays the same
for the execution timeout means the worker is hung."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from opentelemetry.trace import SpanContext

from service.inference.jobs import Answer, InferJob
from service.queues import records, replies, wakeups
from service.queues.ring import Corrupt
from service.workers import deaths, protocol
from service.workers.shm import Segment
from service.workers.worker_process import State

MIN_WATCH_S = 0.05
WATCH_PARTS = 4  # the watchdog looks this often per execution timeout


@dataclass(eq=False)
class Entry:
    """One request from the moment it is queued until its answer or its end."""

    job: InferJob
    future: asyncio.Future[Answer]
    arrival: float
    expires: float | None
    deadline: float | None
    priority: int
    inputs: list[tuple[int, tuple[int, ...], bytes]]
    outputs: tuple[int, ...]
    expected: replies.Expected
    trace: SpanContext  # the request's span, which its batch's span links to
    crashes: int = 0
    alone: bool = False
    queue: InstanceQueue | None = None  # the queue it was written to; None: not written
    request_id: int = 0
    written: float = 0.0  # when it was written (loop time)
    ended: bool = field(default=False)  # answered, failed or dropped: counted out


class QueueHost(Protocol):
    """An instance whose worker takes requests from queues: the server's WorkerInstance, or
    a front-end's view of one (service/frontends/remote_instances.py)."""

    state: State
    start_failure: str | None
    launch: int
    execution_timeout_s: float | None
    on_ready: Callable[[], None] | None
    on_ended: Callable[[deaths.Death], None] | None
    on_start_failed: Callable[[], None] | None
    queue_held: Callable[[], int] | None
    queue_served: Callable[[], bool] | None

    @property
    def numa_node(self) -> int: ...

    def send_queues(self, setup: protocol.Queues, fds: list[int]) -> None: ...

    def kill_misbehaving(self, reason: str, detail: str | None = None) -> None: ...

    def end_hung(self) -> None: ...


# Every reply one wake-up brought (a batch's come together), with the request each answers.
Replies = Callable[[list[tuple[Entry, replies.Reply]]], None]


class InstanceQueue:
    def __init__(
        self,
        instance: QueueHost,
        setup: protocol.Queues,
        on_replies: Replies,
        on_corrupt: Callable[[str], None],
    ) -> None:
        self.instance = instance
        self._loop = asyncio.get_running_loop()
        self._segment = Segment(setup.layout.size)
        self._requests, self._replies, self._running = setup.layout.caller_end(self._segment.buf)
        self._wake_worker = wakeups.make()
        self._woken = wakeups.make()
        instance.send_queues(setup, [self._segment.fd, self._wake_worker, self._woken])
        self._loop.add_reader(self._woken, self._read)
        self.entries: dict[int, Entry] = {}
        self._ids = itertools.count(1)
        self._signal_due = False
        self._on_replies = on_replies
        self._on_corrupt = on_corrupt
        self._closed = False
        self.broken = False  # the worker wrote what no correct worker writes: being killed
        self._watch: asyncio.TimerHandle | None = None
        # The worker's progress (what it took, its batch) when the watchdog last saw it change.
        self._seen: tuple[tuple[int, int, int], float] = ((0, 0, 0), 0.0)

    @property
    def outstanding(self) -> int:
        return len(self.entries)

    @property
    def load(self) -> int:
        """What choosing an instance weighs: this process's requests in its queues, and what
        the worker says it holds of other processes' (front-ends': --frontends N)."""
        return len(self.entries) + (0 if self._closed else self._running.others_held())

    @property
    def numa_node(self) -> int:
        return self.instance.numa_node

    def running_count(self) -> int:
        """Read by /metrics from its own thread too, where the loop may close the queue (its
        worker ended) between the look at `_closed` and the read: then it runs nothing."""
        try:
            return 0 if self._closed else self._running.batch()[1]
        except ValueError:  # the running area's memory released since
            return 0

    def served(self) -> bool:
        """Whether the worker has ended a batch, anyone's (it writes each one's number into
        every caller's running area): one that dies after serving is no crash loop
        (restarts.py)."""
        return not self._closed and self._running.ended() > 0

    def write(self, entry: Entry) -> bool:
        """The request into the worker's ring; False while the ring is full (or the worker
        has scribbled over it: it is then killed)."""
        if self._closed or self.broken:
            return False
        request_id = next(self._ids)
        try:
            written = records.write_request(
                self._requests,
                request_id,
                entry.inputs,
                entry.outputs,
                entry.priority,
                entry.job.batch_size,
                entry.expires,
                entry.deadline,
                records.ALONE if entry.alone else 0,
            )
        except Corrupt as exc:
            self._broke(f"wrote over its request queue: {exc}")
            return False
        if not written:
            return False
        entry.queue, entry.request_id = self, request_id
        entry.written = self._loop.time()
        self.entries[request_id] = entry
        self._signal_soon()
        self._start_watch()
        return True

    def cancel(self, entry: Entry) -> None:
        """The caller went away: the worker drops the request if it has not run it (its
        answer still comes, as a cancellation); a full ring lets it run."""
        if not self._closed and entry.request_id in self.entries:
            try:
                records.write_cancel(self._requests, entry.request_id)
            except Corrupt as exc:
                self._broke(f"wrote over its request queue: {exc}")
                return
            self._signal_soon()

    def _signal_soon(self) -> None:
        """One wake-up of the worker for all the records of this loop turn."""
        if not self._signal_due:
            self._signal_due = True
            self._loop.call_soon(self._signal)

    def _signal(self) -> None:
        self._signal_due = False
        if not self._closed:
            wakeups.wake(self._wake_worker)

    def _read(self) -> None:
        wakeups.clear(self._woken)
        answered: list[tuple[Entry, replies.Reply]] = []
        try:
            while not (self._closed or self.broken):
                payload = self._replies.take()
                if payload is None:
                    break
                for reply in replies.read_reply(payload, self._expected):
                    answered.append((self.entries.pop(reply.id), reply))
        except Corrupt as exc:
            self._broke(f"wrote a bad reply into its queue: {exc}")
        if answered:
            self._on_replies(answered)

    def _expected(self, request_id: int) -> replies.Expected | None:
        entry = self.entries.get(request_id)
        return None if entry is None else entry.expected

    def _broke(self, reason: str) -> None:
        """Told once: the worker is killed, and nothing more is read from or written to it."""
        if not self.broken:
            self.broken = True
            self._on_corrupt(reason)

    def running(self) -> set[int]:
        """The requests the worker said it was computing (after its death), ours only."""
        try:
            return self._running.running() & self.entries.keys()
        except Corrupt:
            return set()

    def close(self) -> list[Entry]:
        """Stop reading and writing; the requests it held, in the order they were written."""
        if self._closed:
            return []
        self._closed = True
        self._loop.remove_reader(self._woken)
        if self._watch is not None:
            self._watch.cancel()
        os.close(self._woken)
        os.close(self._wake_worker)
        for end in (self._requests, self._replies, self._running):
            end.release()
        self._segment.release()
        entries = list(self.entries.values())
        self.entries.clear()
        return entries

    def _start_watch(self) -> None:
        timeout = self.instance.execution_timeout_s
        if self._watch is None and timeout is not None:
            self._watch = self._loop.call_later(max(timeout / WATCH_PARTS, MIN_WATCH_S), self._look)

    def _look(self) -> None:
        """A worker that holds requests of ours and for the execution timeout neither takes
        a record nor starts or ends a batch is hung (or stopped): one batch running that long,
        or none taken at all."""
        self._watch = None
        timeout = self.instance.execution_timeout_s
        if self._closed or not self.entries or timeout is None:
            return
        progress = (*self._running.batch(), self._requests.taken)
        now = self._loop.time()
        if progress != self._seen[0]:
            self._seen = (progress, now)
        elif now - self._seen[1] >= timeout:
            self.instance.end_hung()
            return
        self._start_watch()
