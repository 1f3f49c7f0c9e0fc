"""The asyncio side of dynamic batching: one queue per model version, batches handed to an
idle instance, or to one that runs a batch only when they are full (so requests accumulate into
batches under load even with no queue delay), and every request answered exactly once.

Inference has no side effects, so a batch whose worker died is not a failure: its requests go
back to the queue. One that was being computed in two batches whose workers both died is a
suspected poison input: it fails with INTERNAL, and identical inputs fail at once for a while
(poison.py), so one input cannot crash-loop a model while the other callers are served."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanContext

from protos.inference import model_config_pb2 as mc
from service.batching.assemble import Batch, plan
from service.batching.queue import BatchPolicy, BatchQueue, Pending, QueueFull, default_queue_size
from service.batching.scheduler_loop import SchedulerLoop
from service.inference import errors
from service.inference.errors import WorkerDied
from service.inference.jobs import Answer, InferJob, InferResult
from service.model.shapes import shape_buckets
from service.resilience.poison import PoisonList

CRASHES_TO_POISON = 2
# Runs a batch padded to its shape bucket, with the spans of its requests (in the server, the
# version's BatchRunner: service/serving/batch_runner.py). A batch runs until its last
# request's deadline (or without one if any has none); each request is answered
# DEADLINE_EXCEEDED at its own deadline meanwhile.
RunBatch = Callable[[Batch, list[SpanContext], float | None], Awaitable[InferResult]]


class Batcher(Protocol):
    """What holds a version's requests until a worker answers them: this module's
    DynamicBatcher, or with --instance-queues the worker's own queues
    (service/serving/queued_batcher.py)."""

    policy: BatchPolicy

    @property
    def queued(self) -> int: ...

    @property
    def in_flight_requests(self) -> int: ...

    def enqueue(self, job: InferJob, deadline: float | None) -> asyncio.Future[Answer]: ...

    async def stop(self) -> None: ...


class DynamicBatcher:
    def __init__(
        self,
        policy: BatchPolicy,
        run_batch: RunBatch,
        capacity: Callable[[], int],
        name: str = "the model",
        instances: Callable[[], int] | None = None,
    ) -> None:
        """`capacity`: the batches the version's instances hold at once; `instances`: how
        many of them run one (by default `capacity`: one batch each). While every instance
        runs one, only full batches go to wait in them (BatchQueue.next_batch)."""
        self.policy = policy
        self.name = name
        self.poison = PoisonList()
        self._run_batch = run_batch
        self._capacity = capacity
        self._instances = instances or capacity
        # Requests that may fill a batch (each holds at least one row): _can_send.
        self._fills = (
            min((*policy.preferred_sizes, policy.max_batch_size)) if policy.max_batch_size else 1
        )
        self._queue = BatchQueue(policy)
        self._in_flight = 0
        self.in_flight_requests = 0
        self._loop = SchedulerLoop(self._schedule)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def enqueue(self, job: InferJob, deadline: float | None) -> asyncio.Future[Answer]:
        """The request queued, without waiting for it: its answer's future, failed with
        DEADLINE_EXCEEDED at `deadline`; cancelling it takes the request out of the queue. A
        caller may await it or add a done-callback (a described call has no task of its
        own)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        queue_timeout = self.policy.timeout_of(job.timeout_s)
        timeout_at = None if queue_timeout is None else now + queue_timeout
        limits = [t for t in (deadline, timeout_at) if t is not None]
        if self.poison and self.poison.holds(job, now):
            raise errors.internal(self._poison_message())
        future: asyncio.Future[Answer] = loop.create_future()
        pending = Pending(
            job, now, min(limits, default=None), self.policy.priority_of(job.priority)
        )
        pending.deadline = deadline
        pending.ticket = future
        pending.trace = trace.get_current_span().get_span_context()
        try:
            self._queue.push(pending)
        except QueueFull as exc:
            raise errors.ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        self._loop.ensure_running()
        if self._can_send() or _sooner(pending.expires, self._loop.sleep_until):
            # Otherwise nothing can be sent before a batch ends (which wakes the scheduler) and
            # the scheduler's next look comes before this request's queue time runs out: under
            # load that spares one scheduler turn per request.
            self._loop.wake()
        timer = None if deadline is None else loop.call_at(deadline, self._expire, pending)
        future.add_done_callback(functools.partial(self._settled, pending, timer))
        return future

    def _can_send(self) -> bool:
        """Whether a batch could go now: an instance is idle, or one has room for a batch
        waiting in it and the queue holds enough requests to fill one (a request holds at
        least one row: a wake-up this misses comes when the running batch ends)."""
        if self._in_flight < max(self._instances(), 1):
            return True
        return self._in_flight < self._capacity() and len(self._queue) >= self._fills

    def _expire(self, pending: Pending) -> None:
        """The caller's deadline passed before its batch finished."""
        if not pending.ticket.done():
            self._queue.remove(pending)
            waited = asyncio.get_running_loop().time() - pending.arrival
            pending.ticket.set_exception(
                errors.deadline_exceeded(
                    f"the request's deadline passed after {waited:.3f} s, before its batch finished"
                )
            )

    def _settled(
        self, pending: Pending, timer: asyncio.TimerHandle | None, future: asyncio.Future[Answer]
    ) -> None:
        if timer is not None:
            timer.cancel()
        if future.cancelled():  # its caller went away
            self._queue.remove(pending)

    async def stop(self) -> None:
        await self._loop.stop()

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            for item in self._queue.expire(now):
                _fail(
                    item,
                    errors.deadline_exceeded(
                        f"the request waited {now - item.arrival:.3f} s in the queue and timed "
                        "out before reaching a worker"
                    ),
                )
            if self._in_flight >= max(self._capacity(), 1):
                await self._loop.sleep(self._queue.next_expiry())
                continue
            # Only-full needs a batch in flight, whose end wakes this loop again (a restarting
            # instance counts as one: a batch sent to it waits for the restart).
            action = self._queue.next_batch(now, self._in_flight >= max(self._instances(), 1))
            if action is None or isinstance(action, float):
                await self._loop.sleep(action)
                continue
            self._in_flight += 1
            self._loop.start(self._execute(action))

    async def _run(self, batch: list[Pending]) -> None:
        """Run one batch and answer its requests; on failure raise, answering none. Once each
        of its requests has ended otherwise (its caller went away, its deadline passed), the
        run is cancelled, which ends the BLS calls a Python model makes for it. It runs in the
        batch's own task (no task of its own: one less per batch, and one less loop turn)."""
        started = asyncio.get_running_loop().time()
        deadlines = [item.deadline for item in batch]
        planned = plan([item.job for item in batch], self.policy.shapes)
        task = asyncio.current_task()
        assert task is not None
        running, abandoned = True, False

        def ended(_: object) -> None:
            nonlocal abandoned
            if running and not abandoned and all(item.ticket.done() for item in batch):
                abandoned = True
                task.cancel()

        for item in batch:
            item.ticket.add_done_callback(ended)
        try:
            result = await self._run_batch(
                planned,
                [item.trace for item in batch],
                None if None in deadlines else max(d for d in deadlines if d is not None),
            )
        except asyncio.CancelledError:
            if abandoned and task.uncancel() == 0:
                return
            raise
        finally:
            running = False
            for item in batch:
                item.ticket.remove_done_callback(ended)
        rows = planned.formed
        for item, outputs in zip(batch, result.outputs, strict=True):
            waited = int((started - item.arrival) * 1e9) + result.queue_ns
            if not item.ticket.done():
                item.ticket.set_result(Answer(outputs, result.timings, waited, rows))

    async def _execute(self, batch: list[Pending]) -> None:
        if self.poison:  # identical to an input found poisonous while it waited
            now = asyncio.get_running_loop().time()
            for item in batch:
                if self.poison.holds(item.job, now):
                    _fail(item, errors.internal(self._poison_message()))
        batch = [item for item in batch if not item.ticket.done()]
        self.in_flight_requests += len(batch)
        try:
            if batch:
                await self._attempt(batch)
        except Exception as exc:
            for item in batch:
                _fail(item, errors.internal(f"batch execution failed: {exc}"))
        finally:
            self._in_flight -= 1
            self.in_flight_requests -= len(batch)
            self._loop.wake()

    async def _attempt(self, batch: list[Pending]) -> None:
        try:
            await self._run(batch)
        except WorkerDied as exc:
            self._after_crash(batch, exc)
        except errors.ServiceError as exc:
            if exc.code != grpc.StatusCode.INVALID_ARGUMENT or len(batch) == 1:
                for item in batch:
                    _fail(item, exc)
                return
            # One request's values failed the whole batch: run each alone, so only
            # that request fails and the others are unaffected.
            for item in batch:
                await self._attempt([item])

    def _after_crash(self, batch: list[Pending], exc: WorkerDied) -> None:
        """Queue the batch again; a request the worker was computing when it died twice is
        suspected poison. A batch that was only waiting in the worker never ran: it goes back
        as it was."""
        now = asyncio.get_running_loop().time()
        for item in batch:
            if item.ticket.done():
                continue
            if exc.running:
                item.crashes += 1
                if item.crashes >= CRASHES_TO_POISON:
                    self.poison.add(item.job, now)
                    _fail(item, errors.internal(self._poison_message()))
                    continue
            self._queue.requeue(item, alone=exc.running)

    def _poison_message(self) -> str:
        return poison_message(self.name, self.poison)


def poison_message(name: str, poison: PoisonList) -> str:
    return (
        f"suspected poison input: the worker of {name} died {CRASHES_TO_POISON} times while "
        f"computing this input; identical inputs are refused for {poison.ttl_s:.0f} s"
    )


def _sooner(when: float | None, than: float | None) -> bool:
    """Whether `when` comes before `than` (None: never)."""
    return when is not None and (than is None or when < than)


def _fail(item: Pending, error: errors.ServiceError) -> None:
    if not item.ticket.done():
        item.ticket.set_exception(error)


def policy_from_config(config: mc.ModelConfig, instances: int) -> BatchPolicy:
    """Triton's config: dynamic_batching present -> batch up to max_batch_size; absent -> every
    request runs alone (still queued here, so the instances are never oversubscribed). The
    queue is always bounded: default_queue_policy.max_queue_size, else default_queue_size."""
    shapes = shape_buckets(config)
    if not config.HasField("dynamic_batching") or config.max_batch_size == 0:
        return BatchPolicy(
            max_batch_size=0, max_queue_size=default_queue_size(1, instances), shapes=shapes
        )
    batching = config.dynamic_batching
    queue = batching.default_queue_policy
    return BatchPolicy(
        max_batch_size=config.max_batch_size,
        preferred_sizes=tuple(sorted(s for s in batching.preferred_batch_size if s > 0)),
        max_queue_delay_s=batching.max_queue_delay_microseconds / 1e6,
        max_queue_size=queue.max_queue_size or default_queue_size(config.max_batch_size, instances),
        priority_levels=batching.priority_levels,
        default_priority=batching.default_priority_level,
        default_timeout_s=(
            queue.default_timeout_microseconds / 1e6 if queue.default_timeout_microseconds else None
        ),
        allow_timeout_override=queue.allow_timeout_override,
        shapes=shapes,
    )
