"""The dynamic batcher's decisions, driven by explicit times (a fake clock: nothing sleeps).

The driver's tests run on an event loop whose clock moves only when every task waits for a
timer (tests/virtual_time.py), and wait for states (a batch reached the instance, requests are
queued), never for a number of scheduler turns: what a batch holds follows from what was queued
when the instance had room, however slow the machine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import grpc
import numpy as np
import pytest
from google.protobuf import text_format

from oip.datatypes import BY_NAME
from protos.inference import model_config_pb2 as mc
from service.batching.assemble import Batch, BatchOutput, plan
from service.batching.batcher import DynamicBatcher, policy_from_config
from service.batching.queue import BatchPolicy, BatchQueue, Pending, QueueFull, default_queue_size
from service.inference import errors
from service.inference.errors import WorkerDied
from service.inference.jobs import Answer, InferJob, InferResult, InputTensor, Timings
from service.resilience.poison import PoisonList, fingerprint
from tests.virtual_time import VirtualTimePolicy

FP32 = BY_NAME["FP32"]
# Enough for any state these tests wait for to come about; only a broken batcher exhausts it.
TURNS = 10_000


@pytest.fixture(scope="module")
def event_loop_policy() -> asyncio.AbstractEventLoopPolicy:
    return VirtualTimePolicy()


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the other tasks run until `condition` holds; a bounded number of turns, so that a
    broken batcher fails here by name instead of hanging."""
    for _ in range(TURNS):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


def job(
    rows: int = 1, width: int = 4, outputs: tuple[str, ...] = ("y",), fill: float = 0
) -> InferJob:
    data = np.full((rows, width), fill, np.float32).tobytes()
    return InferJob((InputTensor("x", FP32, (rows, width), data),), outputs, rows)


def written(batch: Batch) -> list[bytes]:
    """Each input as the batch writes it into a worker's shared memory."""
    buffers = [bytearray(tensor.nbytes) for tensor in batch.inputs]
    for tensor, buffer in zip(batch.inputs, buffers, strict=True):
        tensor.write(memoryview(buffer))
    return [bytes(buffer) for buffer in buffers]


def pending(at: float, rows: int = 1, expires: float | None = None, **kwargs: object) -> Pending:
    return Pending(job(rows, **kwargs), at, expires)  # type: ignore[arg-type]


def sizes(batch: object) -> list[int]:
    assert isinstance(batch, list), batch
    return [p.rows for p in batch]


def test_no_delay_sends_what_is_there_at_once() -> None:
    queue = BatchQueue(BatchPolicy(max_batch_size=8))
    for t in (0.0, 0.1, 0.2):
        queue.push(pending(t))
    assert sizes(queue.next_batch(0.2)) == [1, 1, 1]
    assert queue.next_batch(0.2) is None


def test_full_batch_goes_at_once_and_the_rest_waits_for_the_next() -> None:
    queue = BatchQueue(BatchPolicy(max_batch_size=4, max_queue_delay_s=1.0))
    for t in range(6):
        queue.push(pending(t * 0.001))
    assert sizes(queue.next_batch(0.006)) == [1, 1, 1, 1]
    # Two left: not full, no preferred size: wait for the oldest's window.
    assert queue.next_batch(0.006) == pytest.approx(0.004 + 1.0)
    assert sizes(queue.next_batch(1.005)) == [1, 1]


def test_largest_preferred_size_goes_at_once() -> None:
    queue = BatchQueue(
        BatchPolicy(max_batch_size=16, preferred_sizes=(2, 4), max_queue_delay_s=1.0)
    )
    for t in range(5):
        queue.push(pending(t * 0.001))
    assert sizes(queue.next_batch(0.005)) == [1, 1, 1, 1]  # 4 beats 2
    assert queue.next_batch(0.005) == pytest.approx(0.004 + 1.0)  # 1 left: wait


def test_preferred_size_counts_rows_not_requests() -> None:
    queue = BatchQueue(BatchPolicy(max_batch_size=16, preferred_sizes=(6,), max_queue_delay_s=1.0))
    queue.push(pending(0.0, rows=4))
    assert queue.next_batch(0.0) == pytest.approx(1.0)
    queue.push(pending(0.1, rows=2))
    assert sizes(queue.next_batch(0.1)) == [4, 2]


def test_delay_window_is_measured_from_the_oldest_request() -> None:
    queue = BatchQueue(BatchPolicy(max_batch_size=8, max_queue_delay_s=0.5))
    queue.push(pending(10.0))
    queue.push(pending(10.4))
    assert queue.next_batch(10.45) == pytest.approx(10.5)
    assert sizes(queue.next_batch(10.5)) == [1, 1]


def test_a_batch_never_exceeds_max_batch_size_in_rows() -> None:
    queue = BatchQueue(BatchPolicy(max_batch_size=8))
    for rows in (5, 4, 3):
        queue.push(pending(0.0, rows=rows))
    assert sizes(queue.next_batch(0.0)) == [5]  # 5 + 4 > 8: full
    assert sizes(queue.next_batch(0.0)) == [4, 3]


def test_only_matching_shapes_and_outputs_batch_together() -> None:
    queue = BatchQueue(BatchPolicy(max_batch_size=8))
    queue.push(pending(0.0, width=4))
    queue.push(pending(0.1, width=8))
    queue.push(pending(0.2, width=4))
    queue.push(pending(0.3, width=4, outputs=("z",)))
    first = queue.next_batch(0.3)
    assert [p.arrival for p in first] == [0.0, 0.2]  # type: ignore[union-attr]
    assert [p.arrival for p in queue.next_batch(0.3)] == [0.1]  # type: ignore[union-attr]
    assert [p.arrival for p in queue.next_batch(0.3)] == [0.3]  # type: ignore[union-attr]


def test_max_batch_size_zero_runs_every_request_alone() -> None:
    queue = BatchQueue(BatchPolicy(max_batch_size=0))
    queue.push(pending(0.0))
    queue.push(pending(0.0))
    assert sizes(queue.next_batch(0.0)) == [1]
    assert sizes(queue.next_batch(0.0)) == [1]


def test_queue_full_is_refused_at_once() -> None:
    queue = BatchQueue(BatchPolicy(max_batch_size=8, max_queue_size=2))
    queue.push(pending(0.0))
    queue.push(pending(0.0))
    with pytest.raises(QueueFull):
        queue.push(pending(0.0))


def test_timed_out_requests_leave_the_queue_and_never_batch() -> None:
    queue = BatchQueue(BatchPolicy(max_batch_size=8, max_queue_delay_s=1.0))
    early, late = pending(0.0, expires=0.3), pending(0.1, expires=5.0)
    queue.push(early)
    queue.push(late)
    assert queue.next_batch(0.2) == pytest.approx(0.3)  # wake for the expiry, not the window
    assert queue.expire(0.3) == [early]
    assert sizes(queue.next_batch(1.1)) == [1]
    assert queue.expire(10.0) == []


def test_priorities_go_first_then_arrival_order() -> None:
    policy = BatchPolicy(max_batch_size=2, priority_levels=3, default_priority=2)
    queue = BatchQueue(policy)
    low = Pending(job(), 0.0, None, policy.priority_of(3))
    default = Pending(job(), 0.1, None, policy.priority_of(None))
    high = Pending(job(), 0.2, None, policy.priority_of(1))
    for item in (low, default, high):
        queue.push(item)
    assert queue.next_batch(0.2) == [high, default]
    assert queue.next_batch(0.2) == [low]
    assert policy.priority_of(7) == 2  # out of range: the default level


def test_timeout_override_only_when_allowed() -> None:
    assert BatchPolicy(8, default_timeout_s=1.0).timeout_of(0.1) == 1.0
    allowed = BatchPolicy(8, default_timeout_s=1.0, allow_timeout_override=True)
    assert allowed.timeout_of(0.1) == 0.1
    assert allowed.timeout_of(None) == 1.0


def test_each_requests_rows_go_to_their_offset_and_come_back_as_its_own() -> None:
    jobs = [job(rows, fill=rows) for rows in (1, 3, 2)]
    batch = plan(jobs)
    assert batch.rows == 6 and batch.inputs[0].shape == (6, 4)
    rows = np.frombuffer(written(batch)[0], np.float32).reshape(6, 4)[:, 0]
    assert rows.tolist() == [1, 3, 3, 3, 2, 2]
    out = BatchOutput("y", FP32, (6, 1), memoryview(rows.astype(np.float32).tobytes()))
    parts = batch.split([out])
    assert [np.frombuffer(p[0].data, np.float32).tolist() for p in parts] == [
        [1],
        [3, 3, 3],
        [2, 2],
    ]
    assert [p[0].shape for p in parts] == [(1, 1), (3, 1), (2, 1)]


def test_split_refuses_outputs_without_the_batch_dimension() -> None:
    out = BatchOutput("y", FP32, (1,), b"\0\0\0\0")
    with pytest.raises(errors.ServiceError) as raised:
        plan([job(), job()]).split([out])
    assert raised.value.code == grpc.StatusCode.INTERNAL


class _Executor:
    """Stands in for the worker pool: records batches, answers when the test says so."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.release = asyncio.Event()
        self.fail_with: errors.ServiceError | None = None
        self.fail_once: list[errors.ServiceError] = []
        self.crash_on: float | None = None  # like a worker that dies on this value
        self.deadlines: list[float | None] = []
        self.cancelled = 0  # runs cancelled before they were released

    async def __call__(
        self,
        batch: Batch,
        requests: object = (),
        deadline: float | None = None,
    ) -> InferResult:
        self.batches.append(batch)
        self.deadlines.append(deadline)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail_with is not None:
            raise self.fail_with
        if self.fail_once:
            raise self.fail_once.pop()
        rows = np.frombuffer(written(batch)[0], np.float32).reshape(batch.rows, -1)
        if self.crash_on is not None and (rows == self.crash_on).any():
            raise WorkerDied("the worker process was killed by signal 6", running=True)
        if (rows < 0).any():  # like Paddle on an out-of-range embedding id
            raise errors.invalid("InvalidArgumentError: value out of range")
        data = rows.sum(axis=1, keepdims=True).astype(np.float32)
        output = BatchOutput("y", FP32, data.shape, data.tobytes())
        return InferResult(batch.split([output]), Timings(1, 2, 3), 0)


async def test_requests_accumulate_while_the_instance_is_busy() -> None:
    executor = _Executor()
    # A queue timeout makes each arrival wake the scheduler, which must then hold it back.
    policy = BatchPolicy(max_batch_size=8, default_timeout_s=600.0)
    batcher = DynamicBatcher(policy, executor, lambda: 1)
    first = batcher.enqueue(job(fill=1), None)
    await until(lambda: len(executor.batches) == 1, "the first request reached the instance")
    rest: list[asyncio.Future[Answer]] = []
    for i in range(2, 6):  # one at a time: each arrival is a chance to send too early
        rest.append(batcher.enqueue(job(fill=i), None))
        await until(lambda: batcher.queued == len(rest), f"request {i} queued")
    assert len(executor.batches) == 1  # capacity 1: the rest wait and batch together
    executor.release.set()
    answers = await asyncio.gather(first, *rest)
    assert [b.rows for b in executor.batches] == [1, 4]
    assert [np.frombuffer(a.outputs[0].data, np.float32)[0] for a in answers] == [
        4,
        8,
        12,
        16,
        20,
    ]
    assert [a.batch_rows for a in answers] == [1, 4, 4, 4, 4]
    await batcher.stop()


async def test_behind_a_running_batch_only_a_full_one_waits_in_the_instance() -> None:
    """An instance holds two batches (one running, one waiting in it): while it runs one, the
    queue keeps gathering until it holds a full batch, and that one goes to wait."""
    executor = _Executor()
    policy = BatchPolicy(max_batch_size=4, default_timeout_s=600.0)
    batcher = DynamicBatcher(policy, executor, lambda: 2, instances=lambda: 1)
    answers = [batcher.enqueue(job(fill=1), None)]
    await until(lambda: len(executor.batches) == 1, "the first request reached the instance")
    for i in range(2, 5):
        answers.append(batcher.enqueue(job(fill=i), None))
        await until(lambda: batcher.queued == len(answers) - 1, f"request {i} queued")
    await asyncio.sleep(1.0)  # virtual time: every task has run its course
    assert len(executor.batches) == 1  # three rows of four: they gather
    answers.append(batcher.enqueue(job(fill=5), None))
    await until(lambda: len(executor.batches) == 2, "the full batch went to wait")
    assert executor.batches[1].rows == 4
    answers += [batcher.enqueue(job(fill=i), None) for i in (6, 7)]
    await until(lambda: batcher.queued == 2, "the last two queued")
    executor.release.set()
    await asyncio.gather(*answers)
    assert [b.rows for b in executor.batches] == [1, 4, 2]
    await batcher.stop()


async def test_while_the_only_instance_restarts_a_partial_batch_still_goes_to_wait_for_it() -> None:
    """No instance is ready and none runs a batch: nothing in flight would wake the batcher,
    so a partial batch goes (it waits in the instance for the restart)."""
    executor = _Executor()
    batcher = DynamicBatcher(
        BatchPolicy(max_batch_size=8), executor, lambda: 0, instances=lambda: 0
    )
    answers = [batcher.enqueue(job(fill=i), None) for i in (1, 2)]
    await until(lambda: len(executor.batches) == 1, "the batch went to the restarting instance")
    executor.release.set()
    await asyncio.gather(*answers)
    await batcher.stop()


def test_with_no_idle_instance_only_full_or_preferred_batches_go() -> None:
    queue = BatchQueue(BatchPolicy(max_batch_size=4, preferred_sizes=(3,)))
    for t in range(2):
        queue.push(pending(t * 0.001, expires=5.0 + t))
    assert queue.next_batch(0.01, only_full=True) == 5.0  # gather; look again at the expiry
    queue.push(pending(0.002))
    assert sizes(queue.next_batch(0.01, only_full=True)) == [1, 1, 1]  # the preferred size
    for t in range(5):
        queue.push(pending(0.01 + t * 0.001))
    assert sizes(queue.next_batch(0.02, only_full=True)) == [1, 1, 1, 1]  # full
    assert queue.next_batch(0.02, only_full=True) is None  # one left, no expiry: gather
    assert sizes(queue.next_batch(0.02)) == [1]  # an instance is idle: what is there
    unbatched = BatchQueue(BatchPolicy(max_batch_size=0))
    unbatched.push(pending(0.0))
    assert sizes(unbatched.next_batch(0.0, only_full=True)) == [1]  # every request is full


async def test_a_batch_whose_requests_all_ended_is_cancelled_not_one_that_still_has_one() -> None:
    """Its run is cancelled (which ends the BLS calls a Python model makes for it), and the
    instance's place goes to the next batch."""
    executor = _Executor()
    batcher = DynamicBatcher(BatchPolicy(max_batch_size=8), executor, lambda: 1)
    alone = batcher.enqueue(job(), None)
    await until(lambda: len(executor.batches) == 1, "the first batch reached the instance")
    pair = [batcher.enqueue(job(fill=i), None) for i in (1, 2)]
    await until(lambda: batcher.queued == 2, "the pair queued")
    alone.cancel()
    await until(lambda: len(executor.batches) == 2, "the pair's batch took the place")
    assert executor.cancelled == 1
    pair[0].cancel()
    await asyncio.sleep(0)
    assert executor.cancelled == 1  # the other request of the pair still waits for it
    executor.release.set()
    answer = await pair[1]
    assert np.frombuffer(answer.outputs[0].data, np.float32)[0] == 8
    await batcher.stop()


async def test_worker_failure_fails_every_request_of_the_batch_and_nothing_hangs() -> None:
    executor = _Executor()
    executor.fail_with = errors.unavailable("worker died")
    batcher = DynamicBatcher(BatchPolicy(max_batch_size=8), executor, lambda: 1)
    busy = batcher.enqueue(job(), None)
    await until(lambda: len(executor.batches) == 1, "the first request reached the instance")
    batch = [batcher.enqueue(job(), None) for _ in range(3)]
    await until(lambda: batcher.queued == 3, "the rest queued")
    executor.release.set()
    results = await asyncio.gather(busy, *batch, return_exceptions=True)
    assert [b.rows for b in executor.batches] == [1, 3]
    assert all(isinstance(r, errors.ServiceError) for r in results)
    assert {r.code for r in results if isinstance(r, errors.ServiceError)} == {
        grpc.StatusCode.UNAVAILABLE
    }
    executor.fail_with = None
    assert (await batcher.enqueue(job(fill=2), None)).outputs[0].shape == (1, 1)
    await batcher.stop()


async def test_queue_full_and_deadline_statuses() -> None:
    executor = _Executor()
    policy = BatchPolicy(max_batch_size=8, max_queue_size=1)
    batcher = DynamicBatcher(policy, executor, lambda: 1)
    running = batcher.enqueue(job(), None)
    await until(lambda: len(executor.batches) == 1, "the first request reached the instance")
    loop = asyncio.get_running_loop()
    queued = batcher.enqueue(job(), loop.time() + 0.01)
    await until(lambda: batcher.queued == 1, "the second request queued")
    # The bound (virtual time: it passes at once) turns a queue that admits one too many into
    # a failure instead of a hang.
    with pytest.raises(errors.ServiceError) as full:
        await asyncio.wait_for(batcher.enqueue(job(), None), 60)
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(errors.ServiceError) as expired:
        await queued  # its deadline passes while the instance is busy
    assert expired.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    executor.release.set()
    await running
    assert len(executor.batches) == 1  # the expired request never reached the executor
    await batcher.stop()


async def test_a_queue_timeout_ends_on_time_while_the_instance_is_busy() -> None:
    """A request arriving while no batch can be sent does not wake the scheduler, unless its
    queue time runs out before the scheduler's next look."""
    executor = _Executor()
    policy = BatchPolicy(max_batch_size=8, allow_timeout_override=True)
    batcher = DynamicBatcher(policy, executor, lambda: 1)
    running = batcher.enqueue(job(), None)
    await until(lambda: len(executor.batches) == 1, "the first request reached the instance")
    patient = batcher.enqueue(replace(job(), timeout_s=600.0), None)
    await until(lambda: batcher.queued == 1, "the patient request queued")
    loop = asyncio.get_running_loop()
    with pytest.raises(errors.ServiceError) as expired:
        # The bound only keeps a broken scheduler from hanging the test.
        await asyncio.wait_for(batcher.enqueue(replace(job(), timeout_s=0.01), None), 60)
    assert loop.time() == pytest.approx(0.01)  # its own queue time, not the scheduler's next look
    assert expired.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "in the queue" in expired.value.message
    executor.release.set()
    await asyncio.gather(running, patient)
    assert [b.rows for b in executor.batches] == [1, 1]
    await batcher.stop()


async def test_a_request_with_bad_values_fails_alone_not_its_whole_batch() -> None:
    executor = _Executor()
    batcher = DynamicBatcher(BatchPolicy(max_batch_size=8), executor, lambda: 1)
    busy = batcher.enqueue(job(fill=1), None)
    await until(lambda: len(executor.batches) == 1, "the first request reached the instance")
    fills = [2, -1, 3]
    batch = [batcher.enqueue(job(fill=f), None) for f in fills]
    await until(lambda: batcher.queued == 3, "the batch of three queued")
    executor.release.set()
    await busy
    results = await asyncio.gather(*batch, return_exceptions=True)
    assert isinstance(results[1], errors.ServiceError)
    assert results[1].code == grpc.StatusCode.INVALID_ARGUMENT
    good = [r for i, r in enumerate(results) if i != 1]
    assert [np.frombuffer(r.outputs[0].data, np.float32)[0] for r in good] == [8, 12]  # type: ignore[union-attr]
    assert [b.rows for b in executor.batches] == [1, 3, 1, 1, 1]
    await batcher.stop()


def test_requests_queued_again_keep_their_place_and_run_alone() -> None:
    queue = BatchQueue(BatchPolicy(max_batch_size=8, max_queue_size=2))
    first, second = pending(0.0, expires=5.0), pending(0.1)
    first.deadline = 30.0
    for item in (first, second):
        queue.push(item)
    crashed = queue.next_batch(0.1)
    assert crashed == [first, second]
    queue.push(pending(0.2))  # arrived while the batch ran
    for item in (first, second):
        queue.requeue(item, alone=True)  # over max_queue_size: they were admitted already
    assert first.expires == 30.0  # the queue timeout was for the first wait; the deadline holds
    assert queue.next_batch(0.3) == [first]
    assert queue.next_batch(0.3) == [second]
    assert sizes(queue.next_batch(0.3)) == [1]


def test_requests_that_only_waited_behind_a_crash_batch_as_before() -> None:
    queue = BatchQueue(BatchPolicy(max_batch_size=8))
    items = [pending(t) for t in (0.0, 0.1)]
    for item in items:
        queue.requeue(item, alone=False)
    assert queue.next_batch(0.2) == items


def test_queues_are_bounded_by_default() -> None:
    assert default_queue_size(max_batch_size=64, instances=2) == 8 * 64 * 2
    assert default_queue_size(max_batch_size=1, instances=1) == 64
    assert default_queue_size(max_batch_size=0, instances=1) == 64
    batching = text_format.Parse(
        "max_batch_size: 16 dynamic_batching { }", mc.ModelConfig(name="m")
    )
    assert policy_from_config(batching, 3).max_queue_size == 8 * 16 * 3
    batching.dynamic_batching.default_queue_policy.max_queue_size = 5
    assert policy_from_config(batching, 3).max_queue_size == 5
    unbatched = mc.ModelConfig(name="m", max_batch_size=0)
    assert policy_from_config(unbatched, 1).max_queue_size == 64


async def test_a_crashed_batch_runs_again_and_only_the_poison_input_fails() -> None:
    executor = _Executor()
    executor.crash_on = 13.0
    batcher = DynamicBatcher(BatchPolicy(max_batch_size=8), executor, lambda: 1, "model 'm'")
    busy = batcher.enqueue(job(fill=1), None)
    await until(lambda: len(executor.batches) == 1, "the first request reached the instance")
    batch = [batcher.enqueue(job(fill=f), None) for f in (2, 13, 3)]
    await until(lambda: batcher.queued == 3, "the batch of three queued")
    executor.release.set()
    await busy
    results = await asyncio.gather(*batch, return_exceptions=True)
    poison = results[1]
    assert isinstance(poison, errors.ServiceError), poison
    assert poison.code == grpc.StatusCode.INTERNAL
    assert "suspected poison input" in poison.message and "model 'm'" in poison.message
    good = [results[0], results[2]]
    assert [np.frombuffer(r.outputs[0].data, np.float32)[0] for r in good] == [8, 12]  # type: ignore[union-attr]
    # The batch of three crashed once; alone, only the poison input crashed again.
    assert [b.rows for b in executor.batches] == [1, 3, 1, 1, 1]
    with pytest.raises(errors.ServiceError) as again:
        await batcher.enqueue(job(fill=13), None)
    assert again.value.code == grpc.StatusCode.INTERNAL
    assert again.value.message == poison.message
    assert len(executor.batches) == 5  # refused without reaching a worker
    other = await batcher.enqueue(job(fill=5), None)  # everyone else is still served
    assert np.frombuffer(other.outputs[0].data, np.float32)[0] == 20
    await batcher.stop()


async def test_requests_waiting_behind_a_crash_run_again_without_a_strike() -> None:
    executor = _Executor()
    batcher = DynamicBatcher(BatchPolicy(max_batch_size=8), executor, lambda: 1)
    executor.fail_once = [
        WorkerDied("died", running=False),
        WorkerDied("died", running=False),
    ]
    executor.release.set()
    answer = await batcher.enqueue(job(fill=4), None)
    assert np.frombuffer(answer.outputs[0].data, np.float32)[0] == 16
    assert len(executor.batches) == 3
    await batcher.stop()


async def test_a_deadline_ends_its_request_not_its_batch() -> None:
    executor = _Executor()
    batcher = DynamicBatcher(BatchPolicy(max_batch_size=8), executor, lambda: 1)
    loop = asyncio.get_running_loop()
    short = batcher.enqueue(job(fill=1), loop.time() + 0.01)
    far = loop.time() + 60
    long = batcher.enqueue(job(fill=2), far)
    await until(lambda: len(executor.batches) == 1, "the batch reached the instance")
    with pytest.raises(errors.ServiceError) as expired:
        await short
    assert expired.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    executor.release.set()
    assert np.frombuffer((await long).outputs[0].data, np.float32)[0] == 8
    # One batch held both; it ran until its last deadline.
    assert [b.rows for b in executor.batches] == [2]
    assert executor.deadlines == [far]
    await batcher.stop()


def test_poison_list_matches_identical_inputs_only_and_forgets() -> None:
    poison = PoisonList(ttl_s=10.0, max_entries=2)
    assert not poison
    poison.add(job(fill=13), now=0.0)
    assert poison.holds(job(fill=13), now=9.9)
    assert not poison.holds(job(fill=13, width=5), now=1.0)  # another shape
    assert not poison.holds(job(fill=12), now=1.0)  # other bytes
    assert not poison.holds(job(fill=13, outputs=("z",)), now=1.0)  # other outputs
    assert fingerprint(job(fill=13)) == fingerprint(job(fill=13))
    assert not poison.holds(job(fill=13), now=10.0)  # expired
    assert not poison
    for fill, at in ((1, 0.0), (2, 1.0), (3, 2.0)):
        poison.add(job(fill=fill), now=at)
    assert len(poison) == 2  # bounded: the oldest went first
    assert not poison.holds(job(fill=1), now=3.0)
    assert poison.holds(job(fill=2), now=3.0) and poison.holds(job(fill=3), now=3.0)
