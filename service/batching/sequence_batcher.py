"""The asyncio side of sequence batching (sequence_queue.py decides): a model version's
requests of sequences run on the instance each sequence is bound to, with their control inputs
and implicit state added (sequence_tensors.py), and every request answered exactly once.

Unlike a dynamic batch, a request of a sequence is never run again after its worker died: the
worker held the sequence's state (its own, or the batch it was computing), so every sequence
bound to that instance ends, and its requests fail UNAVAILABLE saying it must start again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanContext

from service.batching.assemble import Batch, plan
from service.batching.scheduler_loop import SchedulerLoop
from service.batching.sequence_queue import SequencePolicy, SequenceQueue, Step
from service.batching.sequence_tensors import check_corrid, taken_state, with_sequence_inputs
from service.inference import errors
from service.inference.errors import WorkerDied
from service.inference.identity import Identity
from service.inference.jobs import Answer, InferJob, InferResult
from service.inference.timers import fail_at
from service.model.sequences import SequenceSettings

# Runs a batch on one instance (by its index in the version's instances), in the worker
# process given (a pid: the one holding its sequences' state; WorkerDied when it is gone) or
# whichever runs the instance (None).
RunOn = Callable[[int, Batch, list[SpanContext], float | None, int | None], Awaitable[InferResult]]
# Told of what happens to sequences ("start", "end", "expire", "lost") and how many.
OnSequences = Callable[[str, int], None]


class SequenceBatcher:
    def __init__(
        self,
        policy: SequencePolicy,
        settings: SequenceSettings,
        run_on: RunOn,
        worker_of: Callable[[int], int],
        capacity: Callable[[int], int],
        on_sequences: OnSequences,
    ) -> None:
        self.policy = policy
        self.settings = settings
        self._queue = SequenceQueue(policy)
        self._run_on = run_on
        self._worker_of = worker_of  # an instance's worker process (pid) now
        self._capacity = capacity  # batches an instance can hold at once
        self._on_sequences = on_sequences
        self._in_flight = [0] * max(policy.instances, 1)
        self.in_flight_requests = 0
        self._loop = SchedulerLoop(self._schedule)

    @property
    def queued(self) -> int:
        return self._queue.queued

    @property
    def live(self) -> int:
        return self._queue.live

    def holds(self, corrid: int | str, owner: Identity) -> bool:
        return self._queue.holds(corrid, owner)

    async def submit(self, job: InferJob, deadline: float | None) -> Answer:
        flags = job.sequence
        if flags is None:
            raise errors.invalid(
                f"inference request to {self.policy.name} must specify a non-zero or non-empty "
                "correlation ID (the request parameter sequence_id, with sequence_start on a "
                "sequence's first request and sequence_end on its last)"
            )
        if job.batch_size > 1:
            raise errors.invalid(
                f"a request of a sequence carries one row (batch size 1), not {job.batch_size}: "
                "the server batches the sequences"
            )
        loop = asyncio.get_running_loop()
        now = loop.time()
        limits = [t for t in (deadline, _timeout_at(job, now)) if t is not None]
        future: asyncio.Future[Answer] = loop.create_future()
        check_corrid(flags.corrid, self.settings, self.policy.name)
        step = Step(job, flags.corrid, flags.start, flags.end, now, min(limits, default=None))
        step.deadline, step.ticket, step.owner = deadline, future, flags.owner
        step.trace = trace.get_current_span().get_span_context()
        if self._queue.push(step, now):
            self._on_sequences("start", 1)
        self._loop.wake()
        timer = fail_at(future, deadline, TimeoutError)
        try:
            return await future
        except TimeoutError:
            self._queue.remove(step)
            raise errors.deadline_exceeded(
                f"the request's deadline passed after {loop.time() - now:.3f} s, before its "
                f"sequence's turn ended"
            ) from None
        except asyncio.CancelledError:
            self._queue.remove(step)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def warm(self, job: InferJob, deadline: float) -> None:
        """Run a warm-up job (a shape bucket's rows, as one sequence's start) on every
        instance, outside any sequence: each engine builds its kernels for the shape before
        the version takes traffic."""
        ready = with_sequence_inputs(job, self.settings, 0, None, start=True, end=True)
        batch = plan([ready], self.policy.shapes)
        for instance in range(self.policy.instances):
            await self._run_on(instance, batch, [], deadline, None)

    def lose_instance(self, instance: int, how: str) -> None:
        """The instance's worker died: the sequences bound to it lost their state."""
        steps, lost = self._queue.lose(instance, f"lost its state when its worker {how}")
        for step in steps:
            _fail(step, self._lost(step))
        if lost:
            self._on_sequences("lost", lost)
            self._loop.wake()

    async def stop(self) -> None:
        await self._loop.stop()
        for step in self._queue.close_all():
            _fail(step, errors.unavailable(f"{self.policy.name} is unloading"))

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            expired, idle = self._queue.expire(now)
            for step in expired:
                _fail(
                    step,
                    errors.deadline_exceeded(
                        f"the request waited {now - step.arrival:.3f} s behind its sequence's "
                        "others and timed out before reaching a worker"
                    ),
                )
            if idle:
                self._on_sequences("expire", idle)
            free = [self._in_flight[i] < self._capacity(i) for i in range(len(self._in_flight))]
            action = self._queue.next_batch(now, free)
            if action is None or isinstance(action, float):
                expiry = self._queue.next_expiry()
                wake = min((t for t in (action, expiry) if t is not None), default=None)
                await self._loop.sleep(wake)
                continue
            instance, steps = action
            self._in_flight[instance] += 1
            self.in_flight_requests += len(steps)
            self._loop.start(self._execute(instance, steps))

    async def _execute(self, instance: int, steps: list[Step]) -> None:
        try:
            await self._attempt(instance, steps)
        finally:
            self._in_flight[instance] -= 1
            self.in_flight_requests -= len(steps)
            self._loop.wake()

    async def _attempt(self, instance: int, steps: list[Step]) -> None:
        """Run the requests together; one whose values fail the batch runs again alone, so
        only it fails (and its sequence's state stays as it was)."""
        started = asyncio.get_running_loop().time()
        gone = [s for s in steps if self._queue.sequence(s.corrid, s.owner) is None]
        for step in gone:  # ended since it was chosen (its worker died meanwhile)
            _fail(step, self._lost(step))
        steps = [s for s in steps if s not in gone]
        if not steps:
            return
        try:
            result = await self._run(instance, steps)
        except WorkerDied:
            # The worker holding their state died (lose_instance may not have heard yet).
            lost = [s for s in steps if self._queue.sequence(s.corrid, s.owner) is not None]
            for step in steps:
                for waiting in self._queue.drop(
                    step, grpc.StatusCode.UNAVAILABLE, "lost its state when its worker died"
                ):
                    _fail(waiting, self._lost(waiting))
                _fail(step, self._lost(step))
            if lost:
                self._on_sequences("lost", len(lost))
            return
        except errors.ServiceError as exc:
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT and len(steps) > 1:
                for step in steps:
                    await self._attempt(instance, [step])
                return
            for step in steps:
                self._finish(step, None, None)
                _fail(step, exc)
            return
        rows, worker = len(steps), self._worker_of(instance)
        for step, outputs in zip(steps, result.outputs, strict=True):
            try:
                visible, state = taken_state(outputs, self.settings)
            except errors.ServiceError as exc:
                for waiting in self._queue.drop(step, exc.code, "ended: " + exc.message):
                    _fail(waiting, exc)
                _fail(step, exc)
                self._on_sequences("end", 1)
                continue
            self._finish(step, state, worker)
            waited = int((started - step.arrival) * 1e9) + result.queue_ns
            if not step.ticket.done():
                step.ticket.set_result(Answer(visible, result.timings, waited, rows))

    async def _run(self, instance: int, steps: list[Step]) -> InferResult:
        """Run the requests with their sequences' inputs, in the worker process that holds
        their state (any, for sequences that have not run yet)."""
        jobs, worker = [], None
        for step in steps:
            live = self._queue.sequence(step.corrid, step.owner)
            held = None if step.start or live is None else live.state
            if live is not None and not step.start and live.worker is not None:
                worker = live.worker
            jobs.append(
                with_sequence_inputs(
                    step.job, self.settings, step.corrid, held, step.start, step.end
                )
            )
        deadlines = [s.deadline for s in steps]
        return await self._run_on(
            instance,
            plan(jobs, self.policy.shapes),
            [s.trace for s in steps],
            None if None in deadlines else max(d for d in deadlines if d is not None),
            worker,
        )

    def _finish(self, step: Step, state: dict[str, bytes] | None, worker: int | None) -> None:
        now = asyncio.get_running_loop().time()
        if self._queue.finish(step, now, state, worker):
            self._on_sequences("end", 1)

    def _lost(self, step: Step) -> errors.ServiceError:
        return errors.unavailable(
            f"sequence {step.corrid!r} of {self.policy.name} lost its state when its worker "
            "died; start it again with sequence_start"
        )


def _timeout_at(job: InferJob, now: float) -> float | None:
    return None if job.timeout_s is None else now + job.timeout_s


def _fail(step: Step, error: errors.ServiceError) -> None:
    if not step.ticket.done():
        step.ticket.set_exception(error)
