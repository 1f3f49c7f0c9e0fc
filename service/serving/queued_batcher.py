"""A version's requests written straight into its instances' queues (--instance-queues): the
worker forms the batches (service/workers/queued_worker.py), so this process does no batching
and no scheduling, and hears from a worker once per batch. It keeps the promises of the
batcher it replaces (service/batching/batcher.py): the queue is bounded (RESOURCE_EXHAUSTED at
once), each request is answered exactly once (DEADLINE_EXCEEDED at its deadline), a request
whose caller leaves is dropped from the worker's queue, and a worker's death loses nothing:
what it only queued goes to an instance again as it was, what it was computing goes again to
run alone, and an input it was computing when two workers died is suspected poison."""

from __future__ import annotations

import asyncio
import collections
import functools
import random
from collections.abc import Callable, Sequence
from typing import Protocol

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanContext

from oip.datatypes import BY_CONFIG_TYPE
from protos.inference import model_config_pb2 as mc
from service.batching.batcher import CRASHES_TO_POISON, poison_message
from service.inference import errors
from service.inference.jobs import Answer, InferJob, OutputTensor, Timings
from service.inference.timers import fail_at
from service.queues import records, replies
from service.queues.ring import max_record
from service.registry.versions import ServedVersion
from service.resilience.poison import PoisonList
from service.serving.instance_queues import Entry, InstanceQueue, QueueHost
from service.workers import deaths, protocol, results, routing
from service.workers.worker_process import State


class BatchObserver(Protocol):
    def on_batch(self, model: str, rows: int, timings: Timings) -> None: ...

    def batch_ran(
        self, model: str, version: int, rows: int, requests: Sequence[SpanContext], spent_ns: int
    ) -> None: ...


def batch_recorder(
    served: ServedVersion, observer: BatchObserver
) -> Callable[[int, Timings, list[SpanContext]], None]:
    """What a batch a worker formed from its queues does: counted and traced as the batch
    runner does one."""

    def record(rows: int, timings: Timings, requests: list[SpanContext]) -> None:
        served.stats.record_batch(rows, timings)
        observer.on_batch(served.name, rows, timings)
        spent = timings.input_ns + timings.infer_ns + timings.output_ns
        observer.batch_ran(served.name, served.version, rows, requests, spent)

    return record


class InstanceEvents(Protocol):
    """Told what happens to the version's instances (the parent tells its front-ends)."""

    def ready(self, index: int) -> None: ...

    def ended(self, index: int, death: deaths.Death) -> None: ...

    def start_failed(self, index: int) -> None: ...


class QueuedBatcher:
    def __init__(
        self,
        config: mc.ModelConfig,
        instances: Sequence[QueueHost],
        setup: protocol.Queues,
        on_batch: Callable[[int, Timings, list[SpanContext]], None],
        name: str,
        local_numa: int | None,
    ) -> None:
        """`local_numa`: this process's NUMA node, whose instances it prefers (routing.py)."""
        policy = setup.policy
        self.policy = policy
        self.name = name
        self._model = config.name
        self.poison = PoisonList()
        self._instances = instances
        rows = max(config.max_batch_size, 1)
        self.setup = setup
        self.events: InstanceEvents | None = None
        self.elsewhere = (0, 0)  # what those said they hold: queued, in workers' batches
        self._input_index = {t.name: i for i, t in enumerate(config.input)}
        self._output_index = {t.name: i for i, t in enumerate(config.output)}
        self._outputs = [(t.name, BY_CONFIG_TYPE[t.data_type]) for t in config.output]
        # 0: BYTES, whose elements the reader checks instead (replies.Expected)
        self._itemsizes = tuple(
            0 if d.name == "BYTES" else d.numpy.itemsize for _, d in self._outputs
        )
        self._rows = rows
        self._batches = config.max_batch_size > 0
        self._queues: dict[int, InstanceQueue] = {}  # by instance, while its worker serves
        self._waiting: collections.deque[Entry] = collections.deque()  # for an instance
        self._held = 0  # requests queued or in a worker, not yet answered
        self._limit = policy.max_queue_size + len(instances) * rows
        self._on_batch = on_batch
        self._random = random.Random(0)
        self._local_numa = local_numa

    def start(self) -> None:
        """Serve through the instances' queues: those ready now at once, the others (and
        each after a restart) once their worker is ready; a death hands their requests back."""
        for index, instance in enumerate(self._instances):
            instance.on_ready = functools.partial(self.attach, index)
            instance.on_ended = functools.partial(self._ended, index)
            instance.on_start_failed = functools.partial(self._restart_failed, index)
            if instance.state is State.READY:
                self.attach(index)

    @property
    def queued(self) -> int:
        own = self._held - self._running()
        return own + self.elsewhere[0]

    @property
    def in_flight_requests(self) -> int:
        return self._running() + self.elsewhere[1]

    def held_by_instance(self) -> list[int]:
        """The requests this process holds in each instance's queues."""
        return [
            queue.outstanding if (queue := self._queues.get(i)) else 0
            for i in range(len(self._instances))
        ]

    def _running(self) -> int:
        """Read by /metrics from its own thread too: over a copy made in one step, so a
        worker attached or ended meanwhile changes nothing it sums."""
        return sum(q.running_count() for q in list(self._queues.values()))

    def attach(self, index: int) -> None:
        """The instance's worker is ready: give it its queues (again, after a restart)."""
        instance = self._instances[index]
        old = self._queues.pop(index, None)
        if old is not None:
            self._requeue(old.close(), None)
        queue = InstanceQueue(
            instance, self.setup, self._replied, functools.partial(self._corrupt, index)
        )
        self._queues[index] = queue
        instance.queue_held = lambda: queue.outstanding
        instance.queue_served = queue.served
        self._send_waiting()
        if self.events is not None:
            self.events.ready(index)

    def enqueue(self, job: InferJob, deadline: float | None) -> asyncio.Future[Answer]:
        """As DynamicBatcher.enqueue: the answer's future, failed at `deadline`; cancelling
        it drops the request."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.poison and self.poison.holds(job, now):
            raise errors.internal(self._poison_message())
        if self._held >= self._limit:
            raise errors.ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the queue holds its maximum of {self.policy.max_queue_size} requests",
            )
        queue_timeout = self.policy.timeout_of(job.timeout_s)
        timeout_at = None if queue_timeout is None else now + queue_timeout
        limits = [t for t in (deadline, timeout_at) if t is not None]
        future: asyncio.Future[Answer] = loop.create_future()
        wanted = tuple(self._output_index[name] for name in job.outputs)
        entry = Entry(
            job,
            future,
            now,
            min(limits, default=None),
            deadline,
            self.policy.priority_of(job.priority),
            [(self._input_index[t.name], t.shape, t.data) for t in job.inputs],
            wanted,
            replies.Expected(wanted, self._itemsizes, job.rows if self._batches else 0, self._rows),
            trace.get_current_span().get_span_context(),
        )
        size = records.request_size(
            [(shape, len(data)) for _, shape, data in entry.inputs], len(wanted)
        )
        if size > max_record(self.setup.layout.request_bytes):
            raise errors.ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request takes {size} bytes in an instance queue of {self.name}, which takes "
                f"{max_record(self.setup.layout.request_bytes)} at most (a quarter of "
                "--instance-queue-mb)",
            )
        self._place(entry, refuse=True)
        self._held += 1
        timer = fail_at(
            future,
            deadline,
            lambda: errors.deadline_exceeded(
                f"the request's deadline passed after {loop.time() - now:.3f} s, before its "
                "batch finished"
            ),
        )
        future.add_done_callback(functools.partial(self._settled, entry, timer))
        return future

    def _place(self, entry: Entry, refuse: bool = False) -> None:
        """Into a serving instance's queue (the least busy, by what this process and the
        worker say it holds, near this process first: service/workers/routing.py; else any
        other with room), or to wait for one; `refuse`: a new request, refused when no
        instance can serve it. A request that finds every ring full waits, counted in the
        queue's bound: the worker frees room as it takes records, and each wake-up with its
        answers sends what waits (a full window of a stream's requests can outgrow a ring,
        which refused the last of them while the worker was busy). A new request finding
        others waiting waits behind them: taking the room they wait for would starve them."""
        ready = [q for i, q in self._queues.items() if self._instances[i].state is State.READY]
        if not ready:
            if refuse:
                self._check_startable()
        elif not (refuse and self._waiting):
            queue = routing.choose(ready, self._local_numa, self._random, _load)
            if queue.write(entry) or any(q.write(entry) for q in ready if q is not queue):
                return
        self._waiting.append(entry)

    def _check_startable(self) -> None:
        """UNAVAILABLE when no instance will serve soon: all stopped, or their restarts fail."""
        states = [i.state for i in self._instances]
        if all(s is State.STOPPED for s in states):
            raise errors.unavailable(f"{self.name} is not serving")
        failures = [i.start_failure for i in self._instances]
        if failures and None not in failures:
            raise errors.unavailable(f"{self.name}: its last restart failed: {failures[0]}")

    def _restart_failed(self, index: int) -> None:
        """A restart failed: the requests waiting for an instance fail at once when none can
        serve soon (as a request waiting for a worker's restart does)."""
        if self.events is not None:
            self.events.start_failed(index)
        try:
            self._check_startable()
        except errors.ServiceError as exc:
            refused = exc
            waiting, self._waiting = self._waiting, collections.deque()
            self._end_all(list(waiting), lambda: refused)

    def _send_waiting(self) -> None:
        """What waits, in its order, until one finds no room: those behind it wait on."""
        waiting, self._waiting = self._waiting, collections.deque()
        while waiting:
            entry = waiting.popleft()
            if entry.future.done():
                self._count_out(entry)
                continue
            self._place(entry)
            if self._waiting:
                self._waiting.extend(waiting)
                return

    def _settled(self, entry: Entry, timer: asyncio.TimerHandle | None, future: object) -> None:
        if timer is not None:
            timer.cancel()
        if entry.queue is not None:
            if entry.future.cancelled():
                # Out of the count at once, as out of a batcher's queue: the worker drops it
                # when it reads the mark, and its ring bytes bound what such requests hold.
                entry.queue.cancel(entry)
                self._count_out(entry)
        elif entry in self._waiting:
            self._waiting.remove(entry)
            self._count_out(entry)

    def _count_out(self, entry: Entry) -> None:
        if not entry.ended:
            entry.ended = True
            self._held -= 1

    def _replied(self, answered: list[tuple[Entry, replies.Reply]]) -> None:
        """What one wake-up brought: each answer, and each batch counted once (a batch's
        replies come together, under its number; of several processes holding its requests,
        the one its first answer went to counts it)."""
        batches: dict[int, tuple[list[replies.Reply], list[SpanContext]]] = {}
        for entry, reply in answered:
            self._answered(entry, reply)
            if reply.failure is None:
                counting, traces = batches.setdefault(reply.batch, ([], []))
                traces.append(entry.trace)
                if reply.counts_batch:
                    counting.append(reply)
        for counting, traces in batches.values():
            for reply in counting:
                self._on_batch(reply.batch_rows, reply.timings, traces)
        if self._waiting:
            self._send_waiting()

    def _answered(self, entry: Entry, reply: replies.Reply) -> None:
        self._count_out(entry)
        future = entry.future
        if future.done():
            return
        if reply.failure is not None:
            future.set_exception(self._failure(reply))
            return
        order = {index: place for place, index in enumerate(entry.outputs)}
        outputs = tuple(
            OutputTensor(*self._outputs[t.position], t.shape, bytes(t.data))
            for t in sorted(reply.outputs, key=lambda t: order[t.position])
        )
        waited = int((entry.written - entry.arrival) * 1e9) + reply.queue_ns
        future.set_result(Answer(outputs, reply.timings, waited, reply.batch_rows))

    def _failure(self, reply: replies.Reply) -> errors.ServiceError:
        if reply.failure == replies.EXPIRED:
            return errors.deadline_exceeded(reply.text)
        if reply.failure == replies.CANCELLED:
            return errors.ServiceError(grpc.StatusCode.CANCELLED, reply.text)
        failed = protocol.Failed(0, reply.text, reply.failure == replies.TOO_LARGE)
        return results.failure(failed, self._model)

    def _corrupt(self, index: int, reason: str) -> None:
        """The worker wrote what no correct worker writes: killed, its requests failed for
        good (its death comes as a protocol breach)."""
        self._instances[index].kill_misbehaving(reason)

    def _ended(self, index: int, death: deaths.Death) -> None:
        """The worker died: its requests go again, or fail as its death decides."""
        if self.events is not None:
            self.events.ended(index, death)
        queue = self._queues.pop(index, None)
        if queue is None:
            return
        running = queue.running() if death.blamed else set()
        held = queue.close()
        message = (
            f"the worker process for {self.name} {death.how} while holding this request; it "
            "is being restarted"
        )
        if death.fate is deaths.Fate.FAIL:
            refused = errors.internal(f"{message}; the request is not run again")
            self._end_all(held, lambda: refused)
        elif death.fate is deaths.Fate.EXHAUSTED:
            self._end_all(held, lambda: errors.resource_exhausted(message))
        else:
            self._requeue(held, running)

    def _end_all(self, held: list[Entry], error: Callable[[], errors.ServiceError]) -> None:
        for entry in held:
            self._count_out(entry)
            if not entry.future.done():
                entry.future.set_exception(error())

    def _requeue(self, held: list[Entry], running: set[int] | None) -> None:
        """Back to an instance: what the worker ran to run alone, counted against it (two
        such deaths: poison)."""
        now = asyncio.get_running_loop().time()
        for entry in held:
            if entry.future.done():
                self._count_out(entry)
                continue
            if running and entry.request_id in running:
                entry.crashes += 1
                if entry.crashes >= CRASHES_TO_POISON:
                    self.poison.add(entry.job, now)
                    self._count_out(entry)
                    entry.future.set_exception(errors.internal(self._poison_message()))
                    continue
                entry.alone = True
            entry.queue = None
            self._place(entry)

    async def stop(self) -> None:
        """Every request still held fails (the server is shutting down)."""
        held = [e for q in self._queues.values() for e in q.close()]
        self._queues.clear()
        held.extend(self._waiting)
        self._waiting.clear()
        for instance in self._instances:
            instance.on_ready = instance.on_ended = instance.on_start_failed = None
            instance.queue_held = instance.queue_served = None
        self._end_all(held, lambda: errors.unavailable("the server is shutting down"))

    def _poison_message(self) -> str:
        return poison_message(self.name, self.poison)


def _load(queue: InstanceQueue) -> int:
    return queue.load
