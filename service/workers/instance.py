"""The front-end's handle on one worker process: its state machine (start, detect death,
restart), reading its messages, and the requests sent to it.

The asyncio loop watches the worker's socket directly (no thread per worker). Batches go to the
worker through its shared-memory slots (slot_batches.py).

A worker runs its requests one after the other, so the oldest one it holds is the one it is
running. A watchdog gives that one `execution_timeout_s` of execution time (while it waits on
its BLS calls, only its CPU time counts); a worker still on it after that is hung (or stopped)
and is killed, which ends like any other death: the requests it held fail with WorkerDied,
which the batcher answers by queueing them again. A worker that breaks the protocol (a message
larger than message_bounds allows it now, one that cannot be read) is killed too, but its
requests fail for good: its model would do it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from oip.datatypes import Datatype
from service.batching.assemble import Batch
from service.inference import errors
from service.inference.errors import WorkerDied
from service.inference.jobs import InferJob, InferResult
from service.inference.waits import Wait, WaitGraph
from service.workers import (
    bls_calls,
    deaths,
    launch,
    model_output,
    protections,
    protocol,
    restarts,
    results,
    streams,
)
from service.workers.model_metrics import SERVER_METRICS
from service.workers.slot_batches import SlotBatches
from service.workers.slots import SegmentChannel, Slot
from service.workers.spec import WorkerSpec
from service.workers.streams import StreamRequest
from service.workers.watchdog import Watchdog, process_cpu_s

log = logging.getLogger("paddlequic.worker")

READY_WAIT_S = 60.0
OUTPUT_DRAIN_S = 2.0


class State(enum.Enum):
    STARTING = "STARTING"
    READY = "READY"
    RESTARTING = "RESTARTING"
    STOPPED = "STOPPED"


class WorkerInstance:
    def __init__(
        self,
        spec: WorkerSpec,
        waits: WaitGraph,
        output: model_output.ModelOutput | None = None,
    ) -> None:
        """`waits`: the process's wait-for graph; `output`: where its Python model's prints
        go, within their budget (shared by the version's instances); by default a budget of
        its own."""
        self.spec = spec
        self.output = output or model_output.ModelOutput(
            spec.model_name, model_output.OutputBudget()
        )
        # The process's waits: a batch sent here holds its callers until it is answered.
        self._waits = waits
        self._me = frozenset({id(self)})
        self.state = State.STARTING
        self.pid = 0
        self.restarts = 0
        self.launch = 0  # the number of the worker process now serving (one per start)
        self.loaded: protocol.Loaded | None = None
        self._ready = asyncio.Event()
        # Set once the current (re)start attempt ended, ready or not: what waiters wake on.
        self._attempted = asyncio.Event()
        self._ids = itertools.count(1)
        self._writer: asyncio.StreamWriter | None = None
        self._segments: SegmentChannel | None = None
        self._process: launch.Launcher | None = None  # the worker's launcher
        self._cgroup: Path | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._output_readers: set[model_output.OutputReader] = set()
        self._restart_task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Future[None] | None = None
        self._started_at = 0.0
        self._restart_delay = 0.0
        self.execution_timeout_s = spec.execution_timeout_s
        self._watchdog = Watchdog(self._kill_hung, lambda: process_cpu_s(self.pid))
        self._killed_hung = False
        # Why the worker was killed for breaking the protocol: its requests then fail, never
        # run again (what a model sends on purpose it would send again).
        self._misbehaved: str | None = None
        self.refused_messages = 0  # workers killed for breaking the protocol (metrics)
        self._answered = 0  # results since the worker (re)started
        # Why the last restart failed (e.g. its files are gone); None once one succeeds.
        # Requests then fail at once instead of waiting for a restart that may never come.
        self.start_failure: str | None = None
        self._outputs = results.Outputs()
        self.streams = streams.Streams()  # a decoupled model's requests in this worker
        # A Python model's BLS calls; the lifecycle sets their handler.
        self.bls = bls_calls.BlsCalls(id(self), self._send, self._watch_oldest)
        self._batches = SlotBatches(spec, self._outputs, self.bls, self._watch_oldest)
        # Told how the worker died, before its requests fail (a sequence model's batcher:
        # the state the worker held for its sequences is gone).
        self.on_death: Callable[[str], None] | None = None
        # With --instance-queues (service/serving/instance_queues.py): told when the worker is
        # ready after a restart, and how it ended when it dies, before it restarts.
        self.on_ready: Callable[[], None] | None = None
        self.on_ended: Callable[[deaths.Death], None] | None = None
        self.queue_held: Callable[[], int] | None = None  # the requests in its queues
        # A decoupled model's requests front-ends hold in it, as they last said (their
        # responses never cross this process): counted in, not exact.
        self.held_elsewhere = 0
        # Whether this launch served through its queues (answers that never cross _read_loop).
        self.queue_served: Callable[[], bool] | None = None
        self.on_start_failed: Callable[[], None] | None = None  # a restart failed
        # Deaths for going past a limit of the model's ("memory", "processes"): metrics.
        self.limit_kills: dict[str, int] = {}

    @property
    def outstanding(self) -> int:
        held = 0 if self.queue_held is None else self.queue_held()
        return len(self._batches) + len(self.streams) + held + self.held_elsewhere

    @property
    def numa_node(self) -> int:
        return self.spec.numa_node

    @property
    def launcher_pid(self) -> int:
        """The worker's launcher (0 before its first start): the root of its processes."""
        return 0 if self._process is None else self._process.pid

    def declare_outputs(
        self, datatypes: Mapping[str, Datatype], fetch_names: Mapping[str, str]
    ) -> None:
        self._outputs.declare(datatypes, fetch_names)

    async def start(self) -> protocol.Loaded:
        """Start the worker and load the model; raises RuntimeError with Paddle's reason."""
        loaded = await self._launch()
        self.loaded = loaded
        protections.warn_unprotected(self.spec, loaded.unprotected if self.spec.python else ())
        return loaded

    @property
    def unprotected(self) -> tuple[str, ...]:
        """What a Python model's sandbox lacks, and for every worker, its cgroup when the host
        offers none (ListInstances)."""
        return protections.unprotected(self.spec, self.loaded)

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

    async def _started(self) -> bool:
        """True if the worker is ready; else waits (bounded) for its current start attempt to
        end and returns False (look again). UNAVAILABLE when it is stopped or cannot start."""
        if self.state is State.STOPPED:
            raise errors.unavailable(self._not_ready_message())
        if self._ready.is_set():
            return True
        if self.start_failure is not None:
            raise errors.unavailable(
                f"{self._not_ready_message()}; its last restart failed: {self.start_failure}"
            )
        try:
            await asyncio.wait_for(self._attempted.wait(), READY_WAIT_S)
        except TimeoutError:
            raise errors.unavailable(self._not_ready_message()) from None
        return False

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

    def _send(self, message: protocol.Message) -> None:
        """To the running worker; nothing once it is gone (its requests ended with it)."""
        if self._writer is not None:
            self._writer.write(protocol.encode(message))

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

    async def stop(self) -> None:
        """Stop the worker; once, however often it is asked (a version that failed to load
        is stopped then, and again with every version at shutdown)."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await self._stopping

    async def _stop(self) -> None:
        self.state = State.STOPPED
        # Answered CANCELLED, so a model waiting in exec() returns and takes the Shutdown.
        self.bls.cancel_all()
        self._ready.clear()
        self._attempted.set()
        if self._restart_task:
            self._restart_task.cancel()
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.write(protocol.encode(protocol.Shutdown()))
                await self._writer.drain()
        if self._process is not None and self._process.returncode is None:
            try:
                await asyncio.wait_for(self._process.wait(), 5)
            except TimeoutError:
                launch.end(self._process)
                await self._process.wait()
        if self._process is not None:
            launch.worker_cgroups().remove(self._cgroup)
        if self._reader_task:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
        self._batches.fail_all(lambda _: errors.unavailable("the server is shutting down"))
        self.streams.died("stopped (the server is shutting down)")
        if self._output_readers:
            # What the worker printed as it stopped is still in its pipe: read to its end
            # (bounded, in case something the worker started keeps it open).
            await asyncio.wait({r.done for r in self._output_readers}, timeout=OUTPUT_DRAIN_S)
        for reader in list(self._output_readers):
            reader.stop()
        self._batches.release()
        if self._segments is not None:
            self._segments.close()

    def _not_ready_message(self) -> str:
        return (
            f"model '{self.spec.model_name}' instance {self.spec.instance_name} is "
            f"{self.state.value.lower()}; retry shortly"
        )

    async def _launch(self) -> protocol.Loaded:
        spawned = await launch.spawn(self.spec)
        if self._segments is not None:
            self._segments.close()
        self._segments = SegmentChannel(spawned.segments)
        self._process = spawned.process
        self._cgroup = spawned.cgroup
        if spawned.output is not None:
            output = model_output.OutputReader(spawned.output, self.output)
            self._output_readers.add(output)
            output.done.add_done_callback(lambda _: self._output_readers.discard(output))
        self.pid = self._process.pid
        self._started_at = time.monotonic()
        self._answered = 0
        self._killed_hung = False
        self._misbehaved = None
        reader, writer = await asyncio.open_unix_connection(sock=spawned.messages)
        self._writer = writer
        try:
            first = await launch.load(self.spec, reader, writer, self._process)
        except BaseException:
            launch.worker_cgroups().remove(self._cgroup)
            raise
        self.pid = launch.worker_pid(self._process.pid)
        self.state = State.READY
        self.launch += 1
        self._ready.set()
        self._attempted.set()
        self._reader_task = asyncio.create_task(self._read_loop(reader, writer))
        if self.on_ready is not None:
            self.on_ready()
        return first

    async def _read_loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                message = await launch.read_message(reader, self._batches.largest_message)
                if message is None:
                    break
                if isinstance(message, protocol.Result | protocol.Failed):
                    self._answered += self._batches.complete(message)
                elif isinstance(message, protocol.Response):
                    # A decoupled model's data response: the worker was serving (restarts.py).
                    self._answered += bool(message.outputs) and message.error is None
                    self.streams.deliver(message)
                elif isinstance(message, protocol.BlsCall):
                    self.bls.start(
                        message, self._batches.caller(message.caller, self.execution_timeout_s)
                    )
                elif isinstance(message, protocol.BlsCancel):
                    self.bls.withdraw(message.call_id)
                elif isinstance(message, protocol.Served):
                    self._answered += 1  # a front-end's response (decoupled_loop.py)
                elif isinstance(message, protocol.MetricUpdate) and self.spec.python:
                    SERVER_METRICS.apply(self.spec.model_name, message)
        except ConnectionError as exc:
            log.warning("worker %s: %s", self.spec.instance_name, exc)
        except Exception as exc:
            # A Python model can write anything to its socket: whatever breaks the protocol
            # (a header declaring more than it may send, a class the unpickler refuses, a
            # field of the wrong type) ends that worker, never the front-end.
            self.kill_misbehaving(
                f"sent {exc}" if isinstance(exc, protocol.Oversized) else repr(exc), repr(exc)
            )
        finally:
            writer.close()
        if self.state is not State.STOPPED:
            await self._on_death()

    def kill_misbehaving(self, reason: str, detail: str | None = None) -> None:
        """The worker broke the protocol (`reason`: how, as its requests' errors say it;
        `detail`: as the log says it, if not the same): it is killed and its requests fail
        for good."""
        log.error(
            "worker %s (pid %d) broke the protocol (%s); killing it and failing its requests",
            self.spec.instance_name,
            self.pid,
            detail or reason,
        )
        self.refused_messages += 1
        self._misbehaved = reason
        if self._process is not None:
            launch.end(self._process)

    def _watch_oldest(self) -> None:
        """Time the batch the worker runs, by its CPU time while it waits for its BLS calls."""
        oldest = self._batches.oldest
        waiting = oldest is not None and self.bls.waiting(oldest)
        self._watchdog.watch(oldest, waiting, self.execution_timeout_s)

    def _kill_hung(self, request_id: int) -> None:
        if request_id in self._batches:
            self.end_hung()

    def end_hung(self) -> None:
        """The worker has run one batch past its execution timeout: killed, its death told
        as a hang."""
        process = self._process
        if self._killed_hung or process is None or process.returncode is not None:
            return
        log.error(
            "worker %s (pid %d) has run one batch for more than %.1f s of execution "
            "(execution_timeout_ms; while it waits on BLS calls only its CPU time counts); "
            "killing it",
            self.spec.instance_name,
            self.pid,
            self.execution_timeout_s,
        )
        self._killed_hung = True
        launch.end(process)

    async def _on_death(self) -> None:
        self.state = State.RESTARTING
        self._ready.clear()
        self._attempted.clear()
        self._writer = None
        code = await self._process.wait() if self._process else None
        launch.worker_cgroups().remove(self._cgroup)
        ended = deaths.death(
            code,
            self._misbehaved,
            self._killed_hung,
            self.execution_timeout_s,
            self.spec.parameters,
            self.spec.python,
        )
        if ended.limit is not None:
            self.limit_kills[ended.limit] = self.limit_kills.get(ended.limit, 0) + 1
        lived = time.monotonic() - self._started_at
        served = self._answered > 0 or (self.queue_served is not None and self.queue_served())
        self._restart_delay = restarts.delay_after_death(self._restart_delay, lived, served)
        log.error(
            "worker %s (pid %d) %s; %d request(s) in it %s; restarting in %.1f s",
            self.spec.instance_name,
            self.pid,
            ended.how,
            self.outstanding,
            ended.fate.value,
            self._restart_delay,
        )
        if self.on_death is not None:
            self.on_death(ended.how)
        if self.on_ended is not None:
            self.on_ended(ended)
        self._batches.fail_all(deaths.requests_error(ended, self.spec.model_name))
        self.bls.cancel_all()
        self.streams.died(ended.how, ended.fate is deaths.Fate.REQUEUE, ended.blamed)
        self._restart_task = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        while self.state is State.RESTARTING:
            await asyncio.sleep(self._restart_delay)
            try:
                await self._launch()
            except (RuntimeError, OSError, TimeoutError) as exc:
                self._restart_delay = restarts.delay_after_failure(self._restart_delay)
                self.start_failure = str(exc)
                self._attempted.set()
                log.error("restarting worker %s failed: %s", self.spec.instance_name, exc)
                if self.on_start_failed is not None:
                    self.on_start_failed()
                continue
            self.start_failure = None
            self.restarts += 1
            log.info("worker %s restarted (pid %d)", self.spec.instance_name, self.pid)
