"""The front-end's handle on one worker instance: the requests sent to it (batches through
its shared-memory slots, slot_batches.py; a decoupled model's requests, streams.py), its
model's BLS calls, and what its messages and its death mean for them. The process's own life
(start, death, restart) is worker_process.py's.

A worker runs its requests one after the other, so the oldest one it holds is the one it is
running. A watchdog gives that one `execution_timeout_s` of execution time (while it waits on
its BLS calls, only its CPU time counts); a worker still on it after that is hung (or stopped)
and is killed, which ends like any other death: the requests it held fail with WorkerDied,
which the batcher answers by queueing them again. A worker that breaks the protocol is killed
too, but its requests fail for good.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping

from oip.datatypes import Datatype
from service.batching.assemble import Batch
from service.inference import errors
from service.inference.errors import WorkerDied
from service.inference.jobs import InferJob, InferResult
from service.inference.waits import Wait, WaitGraph
from service.workers import bls_calls, deaths, launch, model_output, protocol, results, streams
from service.workers.model_metrics import SERVER_METRICS
from service.workers.slot_batches import SlotBatches
from service.workers.slots import Slot
from service.workers.spec import WorkerSpec
from service.workers.streams import StreamRequest
from service.workers.watchdog import Watchdog, process_cpu_s
from service.workers.worker_process import State, WorkerProcess


class WorkerInstance(WorkerProcess):
    def __init__(
        self,
        spec: WorkerSpec,
        waits: WaitGraph,
        output: model_output.ModelOutput | None = None,
    ) -> None:
        """`waits`: the process's wait-for graph; `output`: where its Python model's prints
        go (worker_process.py)."""
        super().__init__(spec, output)
        # The process's waits: a batch sent here holds its callers until it is answered.
        self._waits = waits
        self._me = frozenset({id(self)})
        self._ids = itertools.count(1)
        self._watchdog = Watchdog(self._kill_hung, lambda: process_cpu_s(self.pid))
        self._outputs = results.Outputs()
        self.streams = streams.Streams()  # a decoupled model's requests in this worker
        # A Python model's BLS calls; the lifecycle sets their handler.
        self.bls = bls_calls.BlsCalls(id(self), self._send, self._watch_oldest)
        self._batches = SlotBatches(spec, self._outputs, self.bls, self._watch_oldest)
        self.queue_held: Callable[[], int] | None = None  # the requests in its queues
        # The requests front-ends hold in it, in its queues or on their sockets, as they last
        # said (their answers never cross this process): counted in, not exact.
        self.held_elsewhere = 0

    @property
    def outstanding(self) -> int:
        return self.held_here + self.held_elsewhere

    @property
    def held_here(self) -> int:
        held = 0 if self.queue_held is None else self.queue_held()
        return len(self._batches) + len(self.streams) + held

    @property
    def numa_node(self) -> int:
        return self.spec.numa_node

    def declare_outputs(
        self, datatypes: Mapping[str, Datatype], fetch_names: Mapping[str, str]
    ) -> None:
        self._outputs.declare(datatypes, fetch_names)

    async def infer(
        self, batch: Batch, deadline: float | None, worker: int | None = None
    ) -> InferResult:
        """Run the batch; its result holds each request's outputs, already copied out of the
        slot. `worker`: only in that worker process (the pid a sequence's state lives in);
        WorkerDied when it is gone, even if the instance runs again in another."""
        holds = tuple(Wait(waiter, self._me) for waiter in batch.chain.waiting)
        with self._waits.added(holds):
            return await self._infer(batch, deadline, worker)

    def would_wait_for_itself(self, batch: Batch) -> bool:
        """Whether this batch, sent here, would wait behind a batch waiting (through its BLS
        calls) for this one."""
        return self._waits.blocks(tuple(Wait(w, self._me) for w in batch.chain.waiting))

    async def _infer(self, batch: Batch, deadline: float | None, worker: int | None) -> InferResult:
        started = time.perf_counter_ns()
        slot = await self._ready_slot(deadline)
        if worker is not None and worker != self.pid:
            self._batches.give_back(slot)
            raise WorkerDied(
                f"the worker process for model '{self.spec.model_name}' that held this "
                f"request's state (pid {worker}) is gone; the instance runs as pid {self.pid}",
                running=False,
            )
        return await self._batches.run(
            slot, batch, deadline, next(self._ids), started, self._send_segments, self._send
        )

    def _send_segments(self, slot: Slot) -> None:
        """The slot's segments the worker has not been given yet, before the message naming
        them. The channel never blocks the loop: a worker that stops taking them is killed."""
        assert self._segments is not None
        try:
            self._segments.send(slot)
        except OSError as exc:
            if self._process is not None:
                launch.end(self._process)
            raise errors.unavailable(
                f"the worker for model '{self.spec.model_name}' takes no shared memory "
                f"({exc.strerror or exc}); it is being restarted"
            ) from None

    async def _ready_slot(self, deadline: float | None) -> Slot:
        """A free slot of a ready worker; a worker that dies meanwhile is waited for again
        (bounded), so a request never fails just for arriving during a restart."""
        while True:
            if self.state is State.READY and self._writer is not None:
                slot = self._batches.free_slot()
                if slot is not None:
                    return slot
            if not await self._started():
                continue
            slot = await self._batches.next_free(deadline)
            if self.state is State.READY and self._writer is not None:
                return slot
            self._batches.give_back(slot)

    async def submit(self, job: InferJob, caller_id: str, parameters: str) -> StreamRequest:
        """Start one request of a decoupled model; its responses come through the returned
        handle (streams.py), which the caller closes when done with it."""
        while not await self._started():
            pass
        if self._writer is None:
            raise errors.unavailable(self._not_ready_message())
        model = self.spec.model_name
        return self.streams.start(
            next(self._ids), model, self._outputs, self._send, job, caller_id, parameters
        )

    def send_queues(self, setup: protocol.Queues, fds: list[int]) -> None:
        """Turn the running worker to its shared-memory queues (service/queues/)."""
        assert self._segments is not None
        self._send(setup)
        self._segments.send_fds(fds)

    def add_producer(self, producer: int, fds: list[int]) -> None:
        """Another process holding calls (a front-end) writes into the worker's queues too."""
        assert self._segments is not None
        self._send(protocol.AddProducer(producer))
        self._segments.send_fds(fds)

    def drop_producer(self, producer: int) -> None:
        self._send(protocol.DropProducer(producer))

    def _watch_oldest(self) -> None:
        """Time the batch the worker runs, by its CPU time while it waits for its BLS calls."""
        oldest = self._batches.oldest
        waiting = oldest is not None and self.bls.waiting(oldest)
        self._watchdog.watch(oldest, waiting, self.execution_timeout_s)

    def _kill_hung(self, request_id: int) -> None:
        if request_id in self._batches:
            self.end_hung()

    def _largest_message(self) -> int:
        return self._batches.largest_message()

    def _received(self, message: protocol.Message) -> None:
        if isinstance(message, protocol.Result | protocol.Failed):
            self._answered += self._batches.complete(message)
        elif isinstance(message, protocol.Response):
            # A decoupled model's data response: the worker was serving (restarts.py).
            self._answered += bool(message.outputs) and message.error is None
            self.streams.deliver(message)
        elif isinstance(message, protocol.BlsCall):
            self.bls.start(message, self._batches.caller(message.caller, self.execution_timeout_s))
        elif isinstance(message, protocol.BlsCancel):
            self.bls.withdraw(message.call_id)
        elif isinstance(message, protocol.Served):
            self._answered += 1  # a front-end's response (decoupled_loop.py)
        elif isinstance(message, protocol.MetricUpdate) and self.spec.python:
            SERVER_METRICS.apply(self.spec.model_name, message)

    def _died(self, ended: deaths.Death) -> None:
        self._batches.fail_all(deaths.requests_error(ended, self.spec.model_name))
        self.bls.cancel_all()
        self.streams.died(ended.how, ended.fate is deaths.Fate.REQUEUE, ended.blamed)

    def _stopping_worker(self) -> None:
        # Answered CANCELLED, so a model waiting in exec() returns and takes the Shutdown.
        self.bls.cancel_all()

    def _stopped(self) -> None:
        self._batches.fail_all(lambda _: errors.unavailable("the server is shutting down"))
        self.streams.died("stopped (the server is shutting down)")
        self._batches.release()
