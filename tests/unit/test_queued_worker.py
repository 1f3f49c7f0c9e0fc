"""The worker's batches over several producers (service/workers/queued_worker.py), in this
process with a model of plain numpy (the worker is what is tested, not Paddle): one batch across the
producers' requests, each answer to its own caller, the batch counted once, every running area
numbered, and a caller that reads nothing stalling no other caller and losing nothing."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from service.batching.queue import BatchPolicy
from service.inference.jobs import Timings
from service.queues import records, replies
from service.queues.layout import QueueLayout
from service.queues.ring import RingReader, RingWriter
from service.workers import protocol
from service.workers.queued_worker import QueuedWorker

ROWS = 8
ROW_BYTES = 16  # four FP32 values


class Doubling:
    """A model: its output is its input doubled, row for row."""

    def run(self, arrays: dict[str, Any], outputs: tuple[str, ...]) -> tuple[Any, Timings]:
        return {"out": arrays["input"] * 2}, Timings(1, 2, 3)


class Caller:
    """One producer's end: its segment, rings and running area."""

    def __init__(self, layout: QueueLayout) -> None:
        self.fd = os.memfd_create("queues")
        os.ftruncate(self.fd, layout.size)
        self.segment = mmap.mmap(self.fd, layout.size)
        ends = layout.caller_end(memoryview(self.segment))
        self.requests: RingWriter = ends[0]
        self.replies: RingReader = ends[1]
        self.running = ends[2]
        self.wake_in = os.eventfd(0, os.EFD_NONBLOCK)
        self.wake_out = os.eventfd(0, os.EFD_NONBLOCK)
        self.records = 0  # replies read: one per batch, or per request where they are large

    def send(self, request_id: int, value: float, expires: float | None = None) -> None:
        data = np.full((1, 4), value, np.float32).tobytes()
        assert records.write_request(
            self.requests, request_id, [(0, (1, 4), data)], (0,), 1, 1, expires, None
        )

    def answers(self) -> list[replies.Reply]:
        expected = replies.Expected((0,), (4,), 1, ROWS)
        taken: list[replies.Reply] = []
        while (payload := self.replies.take()) is not None:
            taken += replies.read_reply(payload, lambda _: expected)
            self.records += 1
        return taken

    def release(self) -> None:
        for end in (self.requests, self.replies, self.running):
            end.release()
        self.segment.close()
        for fd in (self.fd, self.wake_in, self.wake_out):
            os.close(fd)


def setup(reply_bytes: int = 1 << 16, batch: int = ROWS) -> protocol.Queues:
    policy = BatchPolicy(max_batch_size=batch)
    layout = QueueLayout(1 << 16, reply_bytes, ROWS)
    return protocol.Queues(layout, policy, (("input", "FP32"),), ("out",))


@pytest.fixture
def callers() -> Iterator[list[Caller]]:
    made: list[Caller] = []
    yield made
    for caller in made:
        caller.release()


def attach(worker: QueuedWorker, callers: list[Caller], key: int, layout: QueueLayout) -> Caller:
    """A caller's segment, mapped in the worker as its own (as it maps the descriptor)."""
    caller = Caller(layout)
    callers.append(caller)
    segment = mmap.mmap(caller.fd, layout.size)
    worker.add(key, segment, os.dup(caller.wake_in), os.dup(caller.wake_out))
    return caller


def test_one_batch_across_producers_answers_each_its_own_and_is_counted_once(
    callers: list[Caller],
) -> None:
    queues = setup()
    worker = QueuedWorker(Doubling(), queues, str, (None, None))
    first = attach(worker, callers, 0, queues.layout)
    second = attach(worker, callers, 1, queues.layout)
    first.send(1, 1.0)
    second.send(1, 5.0)  # the same id: ids are each caller's own
    second.send(2, 7.0)
    worker.take()
    assert worker.step() == 0.0  # one batch of three rows ran
    answers = {0: first.answers(), 1: second.answers()}
    values = {
        k: [np.frombuffer(r.outputs[0].data, np.float32)[0] for r in v] for k, v in answers.items()
    }
    assert values == {0: [2.0], 1: [10.0, 14.0]}
    assert (first.records, second.records) == (1, 1)  # a caller's answers in one record
    every = [r for v in answers.values() for r in v]
    assert {r.batch for r in every} == {1} and {r.batch_rows for r in every} == {3}
    assert sum(r.counts_batch for r in every) == 1
    assert first.running.batch() == (1, 0) and second.running.batch() == (1, 0)
    for key in (0, 1):
        worker.drop(key)


def test_each_caller_reads_how_many_requests_of_the_others_the_worker_holds(
    callers: list[Caller],
) -> None:
    """What a process choosing an instance weighs besides its own: said after each take, the
    batch the step then runs among them, and nothing once the others are answered or gone."""
    queues = setup(batch=2)
    worker = QueuedWorker(Doubling(), queues, str, (None, None))
    first = attach(worker, callers, 0, queues.layout)
    second = attach(worker, callers, 1, queues.layout)
    third = attach(worker, callers, 2, queues.layout)
    for request_id in range(1, 4):
        first.send(request_id, 1.0)
    second.send(1, 2.0)
    worker.take()
    worker.publish()
    assert [c.running.others_held() for c in (first, second, third)] == [1, 3, 4]
    assert worker.step() == 0.0  # a batch of two of the first's
    assert [c.running.others_held() for c in (first, second, third)] == [1, 3, 4]
    worker.take()
    worker.publish()
    assert [c.running.others_held() for c in (first, second, third)] == [1, 1, 2]
    worker.drop(1)  # the second caller gone: its request with it
    worker.take()
    worker.publish()
    assert [c.running.others_held() for c in (first, third)] == [0, 1]
    third.send(1, 3.0)
    worker.take()
    worker.publish()
    assert [c.running.others_held() for c in (first, third)] == [1, 1]
    worker.drop(2)
    worker.take()
    worker.publish()
    assert first.running.others_held() == 0  # alone: nobody else's
    while worker.step() == 0.0:
        pass
    assert len(first.answers()) == 3
    worker.drop(0)


def test_a_caller_that_reads_nothing_stalls_no_other_and_loses_nothing(
    callers: list[Caller],
) -> None:
    """Its reply ring full: its answers wait in the worker while the batch's other answers
    reach their caller, and go into its ring, in order, as it reads."""
    queues = setup(reply_bytes=256)  # room for about one answer
    worker = QueuedWorker(Doubling(), queues, str, (None, None))
    held_still = attach(worker, callers, 0, queues.layout)
    reading = attach(worker, callers, 1, queues.layout)
    for request_id in range(1, 5):
        held_still.send(request_id, float(request_id))
    reading.send(1, 3.0)
    worker.take()
    worker.step()
    assert worker.flush()  # answers wait for the caller held still
    (answer,) = reading.answers()
    assert np.frombuffer(answer.outputs[0].data, np.float32).tolist() == [6.0] * 4
    got: list[float] = []
    while len(got) < 4:
        got += [np.frombuffer(r.outputs[0].data, np.float32)[0] for r in held_still.answers()]
        worker.flush()
    assert got == [2.0, 4.0, 6.0, 8.0]
    assert held_still.records == 4  # together more than its ring takes: each on its own
    assert not worker.flush()
    for key in (0, 1):
        worker.drop(key)


def test_the_requests_of_a_run_are_each_answered_cancelled_or_expired_on_their_own(
    callers: list[Caller],
) -> None:
    """Five requests of one form, taken together as one run: the one its caller cancelled
    and the one whose queue time is over fail as such, the other three run in one batch and
    each gets its own rows."""
    queues = setup()
    worker = QueuedWorker(Doubling(), queues, str, (None, None))
    caller = attach(worker, callers, 0, queues.layout)
    over = time.monotonic() - 1.0
    for request_id in range(1, 6):
        caller.send(request_id, float(request_id), expires=over if request_id == 4 else None)
    assert records.write_cancel(caller.requests, 2)
    worker.take()
    held = worker._waiting.values()  # the four left after the cancel, one run's members
    assert len({m.source for m in held}) == 1 and len(held) == 4  # type: ignore[attr-defined]
    assert worker.step() == 0.0
    by_id = {r.id: r for r in caller.answers()}
    assert by_id[2].failure == replies.CANCELLED
    assert by_id[4].failure == replies.EXPIRED
    values = {i: np.frombuffer(by_id[i].outputs[0].data, np.float32).tolist() for i in (1, 3, 5)}
    assert values == {1: [2.0] * 4, 3: [6.0] * 4, 5: [10.0] * 4}
    assert {by_id[i].batch_rows for i in (1, 3, 5)} == {3}
    assert caller.running.batch() == (1, 0)
    assert worker.step() is None  # nothing left
    worker.drop(0)
