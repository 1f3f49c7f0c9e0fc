"""One worker process's life, as the process that starts it sees it: launched and loaded,
its messages read, its death told (how, what becomes of its requests) and the process started
again (restarts.py times it), or stopped once. What runs on it, and what its messages and its
death mean for the requests it held, is the instance's (instance.py).

The asyncio loop watches the worker's socket directly (no thread per worker). A worker that
breaks the protocol (a message larger than message_bounds allows it now, one that cannot be
read) is killed, and its requests fail for good: its model would do it again. One past its
execution timeout is killed as hung, which ends like any other death.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable
from pathlib import Path

from service.inference import errors
from service.workers import deaths, launch, model_output, protections, protocol, restarts
from service.workers.slots import SegmentChannel
from service.workers.spec import WorkerSpec

log = logging.getLogger("paddlequic.worker")

READY_WAIT_S = 60.0
OUTPUT_DRAIN_S = 2.0


class State(enum.Enum):
    STARTING = "STARTING"
    READY = "READY"
    RESTARTING = "RESTARTING"
    STOPPED = "STOPPED"


class WorkerProcess:
    """The worker process's state machine (start, detect death, restart, stop). A subclass
    says what its messages mean (`_received`), the largest it may send now
    (`_largest_message`), what its death and its stop end (`_died`; `_stopping_worker`,
    `_stopped`), and how many requests it holds (`outstanding`)."""

    def __init__(self, spec: WorkerSpec, output: model_output.ModelOutput | None) -> None:
        """`output`: where its Python model's prints go, within their budget (shared by the
        version's instances); by default a budget of its own."""
        self.spec = spec
        self.output = output or model_output.ModelOutput(
            spec.model_name, model_output.OutputBudget()
        )
        self.state = State.STARTING
        self.pid = 0
        self.restarts = 0
        self.launch = 0  # the number of the worker process now serving (one per start)
        self.loaded: protocol.Loaded | None = None
        self._ready = asyncio.Event()
        # Set once the current (re)start attempt ended, ready or not: what waiters wake on.
        self._attempted = asyncio.Event()
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
        self._killed_hung = False
        # Why the worker was killed for breaking the protocol: its requests then fail, never
        # run again (what a model sends on purpose it would send again).
        self._misbehaved: str | None = None
        self.refused_messages = 0  # workers killed for breaking the protocol (metrics)
        self._answered = 0  # results since the worker (re)started
        # Why the last restart failed (e.g. its files are gone); None once one succeeds.
        # Requests then fail at once instead of waiting for a restart that may never come.
        self.start_failure: str | None = None
        # Told how the worker died, before its requests fail (a sequence model's batcher:
        # the state the worker held for its sequences is gone).
        self.on_death: Callable[[str], None] | None = None
        # With --instance-queues (service/serving/instance_queues.py): told when the worker is
        # ready after a restart, and how it ended when it dies, before it restarts.
        self.on_ready: Callable[[], None] | None = None
        self.on_ended: Callable[[deaths.Death], None] | None = None
        # Whether this launch served through its queues (answers that never cross _read_loop).
        self.queue_served: Callable[[], bool] | None = None
        self.on_start_failed: Callable[[], None] | None = None  # a restart failed
        # Deaths for going past a limit of the model's ("memory", "processes"): metrics.
        self.limit_kills: dict[str, int] = {}

    @property
    def outstanding(self) -> int:
        raise NotImplementedError

    @property
    def held_here(self) -> int:
        """The requests in it this process holds (each front-end logs its own at a death)."""
        raise NotImplementedError

    def _largest_message(self) -> int:
        raise NotImplementedError

    def _received(self, message: protocol.Message) -> None:
        """A message the worker sent (read and checked against `_largest_message`)."""
        raise NotImplementedError

    def _died(self, ended: deaths.Death) -> None:
        """The worker died: what it held ends as `ended` says."""
        raise NotImplementedError

    def _stopping_worker(self) -> None:
        """The server is shutting down, the worker not told yet: what its model waits on
        ends first."""
        raise NotImplementedError

    def _stopped(self) -> None:
        """The server is shutting down and the worker has exited: what it held ends."""
        raise NotImplementedError

    @property
    def launcher_pid(self) -> int:
        """The worker's launcher (0 before its first start): the root of its processes."""
        return 0 if self._process is None else self._process.pid

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

    def _send(self, message: protocol.Message) -> None:
        """To the running worker; nothing once it is gone (its requests ended with it)."""
        if self._writer is not None:
            self._writer.write(protocol.encode(message))

    async def stop(self) -> None:
        """Stop the worker; once, however often it is asked (a version that failed to load
        is stopped then, and again with every version at shutdown)."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await self._stopping

    async def _stop(self) -> None:
        self.state = State.STOPPED
        self._stopping_worker()
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
        self._stopped()
        if self._output_readers:
            # What the worker printed as it stopped is still in its pipe: read to its end
            # (bounded, in case something the worker started keeps it open).
            await asyncio.wait({r.done for r in self._output_readers}, timeout=OUTPUT_DRAIN_S)
        for reader in list(self._output_readers):
            reader.stop()
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
                message = await launch.read_message(reader, self._largest_message)
                if message is None:
                    break
                self._received(message)
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
            self.held_here,
            ended.fate.value,
            self._restart_delay,
        )
        if self.on_death is not None:
            self.on_death(ended.how)
        if self.on_ended is not None:
            self.on_ended(ended)
        self._died(ended)
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
