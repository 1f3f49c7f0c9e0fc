"""What a /metrics scrape reads on the metrics server's thread while the event loop changes it:
the counts a scrape sums over a dict the loop adds to and removes from (a sequence batcher's
live sequences, a queued version's instance queues) are taken over a copy made in one step.
Summed over the dict itself, a thread switch inside the sum let the loop change the dict's
size, and the scrape raised "dictionary changed size during iteration": HTTP 500. And a queue
the loop closes (its worker ended) between the scrape's look at it and its read of the worker's
running area counts nothing, where the read raised on the released memory.

Real threads, switching as often as the interpreter allows, for a bounded number of reads:
without the copies both tests failed in each of six runs; with the copies but without the
released memory's count of 0, the second failed in one run of six."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from service.batching.sequence_queue import SequenceQueue
from service.serving.queued_batcher import QueuedBatcher
from tests.unit.test_instance_choice import STOPPED, Host, config, setup_of
from tests.unit.test_sequence_queue import policy, step

READS = 20_000


@pytest.fixture
def switching() -> Iterator[None]:
    """Threads switch about every microsecond, not every 5 ms."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def read_while(read: Callable[[], int], change: Callable[[], None]) -> list[BaseException]:
    """`read` READS times on a thread of its own while this one calls `change` until it ends;
    what the reads raised."""
    raised: list[BaseException] = []
    done = threading.Event()

    def reader() -> None:
        try:
            for _ in range(READS):
                read()
        except BaseException as exc:
            raised.append(exc)
        done.set()

    thread = threading.Thread(target=reader)
    thread.start()
    while not done.is_set():
        change()
    thread.join()
    return raised


def test_a_sequence_batcher_s_queued_count_is_read_whole_while_sequences_come_and_go(
    switching: None,
) -> None:
    queue = SequenceQueue(policy(oldest=True, max_candidates=10_000))
    corrids = iter(range(1, 1 << 40))

    def change() -> None:
        for _ in range(20):
            queue.push(step(next(corrids), 0.0, start=True), 0.0)
        queue.close_all()

    assert read_while(lambda: queue.queued, change) == []


async def test_a_queued_version_s_count_is_read_whole_while_its_workers_come_and_go(
    switching: None,
) -> None:
    """Its instances' queues are attached as each worker becomes ready and dropped as it dies
    (QueuedBatcher.attach, _ended) on the loop."""
    hosts = [Host(0) for _ in range(8)]
    setup = setup_of(config(), len(hosts))
    batcher = QueuedBatcher(config(), hosts, setup, lambda *_: None, "mlp", None)
    batcher.start()

    def change() -> None:
        for index, host in enumerate(hosts):
            assert host.on_ended is not None
            host.on_ended(STOPPED)
            batcher.attach(index)

    try:
        assert read_while(lambda: batcher.queued, change) == []
    finally:
        for host in hosts:
            assert host.on_ended is not None
            host.on_ended(STOPPED)
            host.release()
