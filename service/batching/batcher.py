"""The asyncio side of dynamic batching: one queue per model version, batches handed to the
instances only while they have room (so requests accumulate into batches under load even with
no queue delay), and every request answered exactly once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanContext

from protos.inference import model_config_pb2 as mc
from service import errors
from service.batching.assemble import join, split
from service.batching.queue import BatchPolicy, BatchQueue, Pending, QueueFull
from service.validation import InferJob
from service.workers.instance import InferResult, OutputTensor
from service.workers.protocol import Timings


@dataclass(frozen=True)
class Answer:
    outputs: tuple[OutputTensor, ...]
    timings: Timings  # of the whole batch
    queue_ns: int  # this request's wait: in the batcher's queue and for a worker slot
    batch_rows: int


class DynamicBatcher:
    def __init__(
        self,
        policy: BatchPolicy,
        run_batch: Callable[[InferJob, list[SpanContext]], Awaitable[InferResult]],
        capacity: Callable[[], int],
    ) -> None:
        self.policy = policy
        self._run_batch = run_batch
        self._capacity = capacity
        self._queue = BatchQueue(policy)
        self._wake = asyncio.Event()
        self._in_flight = 0
        self.in_flight_requests = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(
        self,
        job: InferJob,
        deadline: float | None,
        priority: int | None = None,
        timeout_s: float | None = None,
    ) -> Answer:
        loop = asyncio.get_running_loop()
        now = loop.time()
        queue_timeout = self.policy.timeout_of(timeout_s)
        timeout_at = None if queue_timeout is None else now + queue_timeout
        limits = [t for t in (deadline, timeout_at) if t is not None]
        future: asyncio.Future[Answer] = loop.create_future()
        pending = Pending(job, now, min(limits, default=None), self.policy.priority_of(priority))
        pending.ticket = future
        pending.trace = trace.get_current_span().get_span_context()
        try:
            self._queue.push(pending)
        except QueueFull as exc:
            raise errors.ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = loop.create_task(self._schedule())
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            self._queue.remove(pending)
            raise

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for task in list(self._tasks):
            await asyncio.wait({task})

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
                await self._sleep(self._queue.next_expiry())
                continue
            action = self._queue.next_batch(now)
            if action is None or isinstance(action, float):
                await self._sleep(action)
                continue
            self._in_flight += 1
            task = loop.create_task(self._execute(action))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _sleep(self, until: float | None) -> None:
        self._wake.clear()
        timeout = None if until is None else max(until - asyncio.get_running_loop().time(), 0.0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _run(self, batch: list[Pending]) -> None:
        """Run one batch and answer its requests; on failure raise, answering none."""
        started = asyncio.get_running_loop().time()
        try:
            result = await self._run_batch(
                join([item.job for item in batch]), [item.trace for item in batch]
            )
            parts = split(result, [item.rows for item in batch])
        except errors.ServiceError as exc:
            if len(batch) == 1:
                _fail(batch[0], exc)
            raise
        rows = sum(item.rows for item in batch)
        for item, outputs in zip(batch, parts, strict=True):
            waited = int((started - item.arrival) * 1e9) + result.queue_ns
            if not item.ticket.done():
                item.ticket.set_result(Answer(outputs, result.timings, waited, rows))

    async def _execute(self, batch: list[Pending]) -> None:
        batch = [item for item in batch if not item.ticket.done()]
        self.in_flight_requests += len(batch)
        try:
            if not batch:
                return
            try:
                await self._run(batch)
            except errors.ServiceError as exc:
                if exc.code != grpc.StatusCode.INVALID_ARGUMENT or len(batch) == 1:
                    raise
                # One request's values failed the whole batch: run each alone, so only
                # that request fails and the others are unaffected.
                for item in batch:
                    with contextlib.suppress(errors.ServiceError):
                        await self._run([item])
        except errors.ServiceError as exc:
            for item in batch:
                _fail(item, exc)
        except Exception as exc:
            for item in batch:
                _fail(item, errors.internal(f"batch execution failed: {exc}"))
        finally:
            self._in_flight -= 1
            self.in_flight_requests -= len(batch)
            self._wake.set()


def _fail(item: Pending, error: errors.ServiceError) -> None:
    if not item.ticket.done():
        item.ticket.set_exception(error)


def policy_from_config(config: mc.ModelConfig) -> BatchPolicy:
    """Triton's config: dynamic_batching present -> batch up to max_batch_size; absent -> every
    request runs alone (still queued here, so the instances are never oversubscribed)."""
    if not config.HasField("dynamic_batching") or config.max_batch_size == 0:
        return BatchPolicy(max_batch_size=0)
    batching = config.dynamic_batching
    queue = batching.default_queue_policy
    return BatchPolicy(
        max_batch_size=config.max_batch_size,
        preferred_sizes=tuple(sorted(s for s in batching.preferred_batch_size if s > 0)),
        max_queue_delay_s=batching.max_queue_delay_microseconds / 1e6,
        max_queue_size=queue.max_queue_size,
        priority_levels=batching.priority_levels,
        default_priority=batching.default_priority_level,
        default_timeout_s=(
            queue.default_timeout_microseconds / 1e6 if queue.default_timeout_microseconds else None
        ),
        allow_timeout_override=queue.allow_timeout_override,
    )
