"""One shared-memory segment per worker and process that holds calls: the request ring (that
process writes), the reply ring and the running area (the worker writes), each on cache lines
of its own so neither side's stores touch a line the other writes.

The running area is the batch the worker runs now: its number and its requests' ids, written
before it runs, so when the worker dies the process holding the calls knows which of its
requests were being computed (blamed) and which only waited (sent again as they were), and the
number of the last batch it ended (a worker that dies after serving is no crash loop). A
watchdog reads the batch number: one that does not change for the execution timeout is hung.
It also says how many requests of the worker's other callers it holds, so a process choosing
an instance weighs the work every process gave it, not only its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.queues.ring import CONTROL_BYTES, Corrupt, RingReader, RingWriter

# batch number, request count, the last batch ended, the other callers' requests held
_RUNNING_HEAD = 32
# What a caller takes of the worker's word on its other callers' requests: a count past any
# queue's bound says no more than "busy", and a hostile worker gains nothing by a larger one.
MAX_OTHERS_HELD = 1 << 20
_IDS = _RUNNING_HEAD // 8  # the word the requests' ids start at


def _lines(size: int) -> int:
    return (size + 63) // 64 * 64


@dataclass(frozen=True)
class QueueLayout:
    request_bytes: int  # the request ring's data
    reply_bytes: int  # the reply ring's data
    running_slots: int  # the most requests one batch holds

    @property
    def _running_bytes(self) -> int:
        return _lines(_RUNNING_HEAD + 8 * self.running_slots)

    @property
    def size(self) -> int:
        return 2 * CONTROL_BYTES + self._running_bytes + self.request_bytes + self.reply_bytes

    def _regions(self, buf: memoryview) -> tuple[memoryview, ...]:
        if len(buf) < self.size:
            raise ValueError(f"a queue segment of {len(buf)} bytes; the layout needs {self.size}")
        at = 2 * CONTROL_BYTES
        running = buf[at : at + self._running_bytes]
        at += self._running_bytes
        requests = buf[at : at + self.request_bytes]
        at += self.request_bytes
        replies = buf[at : at + self.reply_bytes]
        controls = buf[:CONTROL_BYTES], buf[CONTROL_BYTES : 2 * CONTROL_BYTES]
        return (*controls, running, requests, replies)

    def caller_end(self, buf: memoryview) -> tuple[RingWriter, RingReader, RunningReader]:
        """The process holding the calls: writes requests, reads replies and the running area."""
        req_control, rep_control, running, requests, replies = self._regions(buf)
        return (
            RingWriter(req_control, requests),
            RingReader(rep_control, replies),
            RunningReader(running, self.running_slots),
        )

    def worker_end(self, buf: memoryview) -> tuple[RingReader, RingWriter, RunningWriter]:
        req_control, rep_control, running, requests, replies = self._regions(buf)
        return (
            RingReader(req_control, requests),
            RingWriter(rep_control, replies),
            RunningWriter(running, self.running_slots),
        )


class RunningWriter:
    """The worker's: the batch it is about to run, then that it ran it."""

    def __init__(self, area: memoryview, slots: int) -> None:
        self._words = area.cast("Q")
        self._slots = slots

    def begin(self, batch: int, ids: list[int]) -> None:
        """Record batch number `batch` before it runs, with the ids of this caller's requests
        in it (none: another caller's batch, which still shows the worker progressing)."""
        if len(ids) > self._slots:
            raise ValueError(f"a batch of {len(ids)} requests; the area holds {self._slots}")
        words = self._words
        for place, request_id in enumerate(ids, start=_IDS):
            words[place] = request_id
        words[1] = len(ids)
        words[0] = batch

    def end(self) -> None:
        words = self._words
        words[1] = 0
        words[2] = words[0]

    def others_held(self, count: int) -> None:
        """How many requests of its other callers the worker holds now."""
        self._words[3] = count

    def release(self) -> None:
        self._words.release()


class RunningReader:
    """The process holding the calls' view of what the worker says it runs."""

    def __init__(self, area: memoryview, slots: int) -> None:
        self._words = area.cast("Q")
        self._slots = slots

    def release(self) -> None:
        self._words.release()

    def batch(self) -> tuple[int, int]:
        """The number of the batch the worker ran last and how many requests it runs now."""
        return self._words[0], min(self._words[1], self._slots)

    def ended(self) -> int:
        """The number of the last batch the worker ended (0: none yet), anyone's."""
        return self._words[2]

    def others_held(self) -> int:
        """How many requests of its other callers the worker says it holds: a hint for
        choosing an instance, clamped, never a count anything else relies on."""
        return min(self._words[3], MAX_OTHERS_HELD)

    def running(self) -> set[int]:
        """The ids of the batch it runs now (as it wrote them: the caller keeps only its own)."""
        count = self._words[1]
        if count > self._slots:
            raise Corrupt(f"a running batch of {count} requests; the area holds {self._slots}")
        return {self._words[_IDS + place] for place in range(count)}
