"""The front-end's handle on one worker process: start, send requests, detect death, restart.

The asyncio loop watches the worker's socket directly (no thread per worker). Tensor bytes go
through a few shared-memory slots per worker, so the next request can be written while the
worker computes the current one.

A worker runs its requests one after the other, so the oldest one it holds is the one it is
running. A watchdog gives that one `execution_timeout_s`; a worker still on it after that is
hung (or stopped) and is killed, which ends like any other death: the requests it held fail
with WorkerDied, which the batcher answers by queueing them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from oip.datatypes import Datatype
from service.backend.load import Load
from service.batching.assemble import Batch, BatchOutput
from service.inference import errors
from service.inference.errors import WorkerDied
from service.inference.jobs import InferResult
from service.inference.timers import fail_at
from service.model.files import PYTHON_BACKEND, ModelFiles
from service.model.shapes import ShapeBuckets
from service.workers import protocol
from service.workers.shm import Segment, layout

log = logging.getLogger("paddlequic.worker")
model_log = logging.getLogger("paddlequic.model")
_T = TypeVar("_T")

# All a Python model's worker sees of the server's environment: nothing secret (TLS keys,
# tokens, ticket keys) can reach model.py through it.
PYTHON_ENV_ALLOWED = ("PATH", "PYTHONPATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
SANDBOX_OFF = ("python_sandbox: off",)
MAX_LOG_LINE = 4096  # characters of one line a Python model prints, in the server's log
SLOTS_PER_WORKER = 2
LOAD_TIMEOUT_S = 600.0
READY_WAIT_S = 60.0
_BAD_INPUT_ERRORS = ("InvalidArgumentError", "OutOfRangeError")
MAX_RESTART_DELAY_S = 30.0


class State(enum.Enum):
    STARTING = "STARTING"
    READY = "READY"
    RESTARTING = "RESTARTING"
    STOPPED = "STOPPED"


class _Slot:
    def __init__(self) -> None:
        self.input = Segment(0)
        self.output = Segment(0)
        self.retired: list[str] = []  # segments replaced since the worker last heard of it

    def _replace(self, segment: Segment, size: int) -> Segment:
        bigger = grown(segment, size)
        if bigger is not segment:
            self.retired.append(segment.name)
        return bigger

    def write(self, batch: Batch) -> tuple[protocol.TensorRef, ...]:
        """Each request's rows straight to their offset in the input segment."""
        offsets, total = layout(t.nbytes for t in batch.inputs)
        self.input = self._replace(self.input, total)
        buf = self.input.buf
        refs = []
        for tensor, offset in zip(batch.inputs, offsets, strict=True):
            tensor.write(buf[offset : offset + tensor.nbytes])
            refs.append(
                protocol.TensorRef(tensor.name, tensor.dtype, tensor.shape, offset, tensor.nbytes)
            )
        return tuple(refs)

    def read(
        self, result: protocol.Result, names: Mapping[str, str], datatypes: Mapping[str, Datatype]
    ) -> list[BatchOutput]:
        """The outputs under the names callers see, as views of the output segment: valid
        until the slot is used again."""
        if result.inline:
            # Grown for next time; while shared memory is short, big results stay inline.
            _, needed = layout(ref.nbytes for ref in result.outputs)
            with contextlib.suppress(errors.ServiceError):
                self.output = self._replace(self.output, needed)
            sources: Mapping[str, bytes | memoryview] = result.inline
        else:
            buf = self.output.buf
            sources = {r.name: buf[r.offset : r.offset + r.nbytes] for r in result.outputs}
        outputs = []
        for ref in result.outputs:
            name = names.get(ref.name, ref.name)
            outputs.append(BatchOutput(name, datatypes[name], ref.shape, sources[ref.name]))
        return outputs

    def release(self) -> None:
        self.input.release()
        self.output.release()


def grown(segment: Segment, size: int) -> Segment:
    """`segment`, or a bigger one replacing it. When shared memory is exhausted the request
    fails with RESOURCE_EXHAUSTED and `segment` stays in use, so the slot keeps working."""
    if size <= segment.size:
        return segment
    try:
        bigger = Segment(size)
    except OSError as exc:
        raise errors.ServiceError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"no shared memory for a request of {size} bytes ({exc.strerror or exc}); "
            "retry later or send less",
        ) from None
    segment.release()
    return bigger


@dataclass
class _Pending:
    future: asyncio.Future[InferResult]
    slot: _Slot
    batch: Batch
    queue_ns: int


@dataclass
class WorkerSpec:
    """What a worker runs and where; placement fills device and environment."""

    instance_name: str
    model_name: str
    files: ModelFiles
    parameters: Mapping[str, str]
    device: str = "cpu"  # what the worker's predictor uses: "cpu" or "gpu"
    env: Mapping[str, str] = field(default_factory=dict)
    numa_node: int = -1
    label: str = "cpu"  # where placement put it, for people
    execution_timeout_s: float | None = None  # the watchdog's limit per batch; None: none
    shapes: ShapeBuckets = field(default_factory=ShapeBuckets)
    backend: str = ""  # "python" for a model.py; otherwise Paddle
    config: bytes = b""  # the serialized ModelConfig, for Python models

    @property
    def python(self) -> bool:
        return self.backend == PYTHON_BACKEND


class WorkerInstance:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.state = State.STARTING
        self.pid = 0
        self.restarts = 0
        self.loaded: protocol.Loaded | None = None
        self._ready = asyncio.Event()
        # Set once the current (re)start attempt ended, ready or not: what waiters wake on.
        self._attempted = asyncio.Event()
        self._slots = [_Slot() for _ in range(SLOTS_PER_WORKER)]
        self._free: asyncio.Queue[_Slot] = asyncio.Queue()
        for slot in self._slots:
            self._free.put_nowait(slot)
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._writer: asyncio.StreamWriter | None = None
        self._segment_channel: socket.socket | None = None
        self._sent: set[str] = set()  # segments the running worker has been given
        self._process: asyncio.subprocess.Process | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._output_tasks: set[asyncio.Task[None]] = set()
        self._restart_task: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self._restart_delay = 0.0
        self.execution_timeout_s = spec.execution_timeout_s
        self._watched: int | None = None  # the request the watchdog times
        self._watchdog: asyncio.TimerHandle | None = None
        self._killed_hung = False
        self._answered = 0  # results since the worker (re)started
        # Why the last restart failed (e.g. its files are gone); None once one succeeds.
        # Requests then fail at once instead of waiting for a restart that may never come.
        self.start_failure: str | None = None
        # Outputs config.pbtxt renames: callers use the configured names, the worker's
        # program its fetch names (fetch_name_N).
        self._fetch_names: dict[str, str] = {}
        self._served_names: dict[str, str] = {}
        self._datatypes: dict[str, Datatype] = {}

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    @property
    def numa_node(self) -> int:
        return self.spec.numa_node

    def declare_outputs(
        self, datatypes: Mapping[str, Datatype], fetch_names: Mapping[str, str]
    ) -> None:
        """The outputs as the model's config declares them (response datatypes come from here,
        not from numpy, which has no BF16), and configured output name -> the program's fetch
        name, for renamed outputs."""
        self._datatypes = dict(datatypes)
        self._fetch_names = dict(fetch_names)
        self._served_names = {fetch: served for served, fetch in fetch_names.items()}

    async def start(self) -> protocol.Loaded:
        """Start the worker and load the model; raises RuntimeError with Paddle's reason."""
        loaded = await self._launch()
        self.loaded = loaded
        if self.spec.python:
            self._warn_unprotected(loaded.unprotected)
        return loaded

    @property
    def unprotected(self) -> tuple[str, ...]:
        """What a Python model's sandbox lacks (ListInstances); () for Paddle models."""
        if not self.spec.python or self.loaded is None:
            return ()
        return SANDBOX_OFF if self.loaded.unprotected is None else self.loaded.unprotected

    def _warn_unprotected(self, unprotected: tuple[str, ...] | None) -> None:
        name = self.spec.model_name
        if unprotected is None:
            log.warning("model %s runs without the Python sandbox (%s)", name, *SANDBOX_OFF)
        for missing in unprotected or ():
            log.warning("model %s: this host lacks a Python sandbox protection: %s", name, missing)

    async def infer(self, batch: Batch, deadline: float | None) -> InferResult:
        """Run the batch; its result holds each request's outputs, already copied out of the
        slot."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter_ns()
        slot = await self._ready_slot(deadline)
        try:
            assert self._writer is not None
            refs = slot.write(batch)
            self._send_segments(slot)
            request_id = next(self._ids)
            outputs = tuple(self._fetch_names.get(n, n) for n in batch.outputs)
            retired, slot.retired = tuple(slot.retired), []
            message = protocol.Infer(
                request_id,
                slot.input.name,
                slot.output.name,
                slot.output.size,
                refs,
                outputs,
                retired,
            )
            future: asyncio.Future[InferResult] = loop.create_future()
            queue_ns = time.perf_counter_ns() - started
            self._pending[request_id] = _Pending(future, slot, batch, queue_ns)
            self._writer.write(protocol.encode(message))
            self._watch_oldest()
        except BaseException:
            self._free.put_nowait(slot)
            raise
        # From here the slot belongs to the pending entry: the worker may still write into it,
        # so only its answer (or its death) gives the slot back.
        timer = fail_at(
            future, deadline, lambda: errors.deadline_exceeded("deadline exceeded in the worker")
        )
        try:
            return await future
        finally:
            if timer is not None:
                timer.cancel()
            if not future.done():
                future.cancel()

    def _send_segments(self, slot: _Slot) -> None:
        """The slot's segments the worker has not been given yet, before the message naming
        them. The channel never blocks the loop: a worker that stops taking them is killed."""
        self._sent.difference_update(slot.retired)
        channel = self._segment_channel
        assert channel is not None
        for segment in (slot.input, slot.output):
            if segment.name in self._sent:
                continue
            try:
                segment.send(channel)
            except OSError as exc:
                if self._process is not None and self._process.returncode is None:
                    self._process.kill()
                raise errors.unavailable(
                    f"the worker for model '{self.spec.model_name}' takes no shared memory "
                    f"({exc.strerror or exc}); it is being restarted"
                ) from None
            self._sent.add(segment.name)

    async def _ready_slot(self, deadline: float | None) -> _Slot:
        """A free slot of a ready worker; a worker that dies meanwhile is waited for again
        (bounded), so a request never fails just for arriving during a restart."""
        while True:
            if self.state is State.READY and self._writer is not None and not self._free.empty():
                return self._free.get_nowait()
            if self.state is State.STOPPED:
                raise errors.unavailable(self._not_ready_message())
            if not self._ready.is_set():
                if self.start_failure is not None:
                    raise errors.unavailable(
                        f"{self._not_ready_message()}; its last restart failed: "
                        f"{self.start_failure}"
                    )
                try:
                    await asyncio.wait_for(self._attempted.wait(), READY_WAIT_S)
                except TimeoutError:
                    raise errors.unavailable(self._not_ready_message()) from None
                continue
            slot = await _until(
                self._free.get(), deadline, "deadline exceeded waiting for a worker"
            )
            if self.state is State.READY and self._writer is not None:
                return slot
            self._free.put_nowait(slot)

    async def stop(self) -> None:
        self.state = State.STOPPED
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
                self._process.kill()
                await self._process.wait()
        if self._reader_task:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
        self._fail_pending(lambda _: errors.unavailable("the server is shutting down"))
        for task in list(self._output_tasks):
            task.cancel()
        for slot in self._slots:
            slot.release()
        if self._segment_channel is not None:
            self._segment_channel.close()

    def _not_ready_message(self) -> str:
        return (
            f"model '{self.spec.model_name}' instance {self.spec.instance_name} is "
            f"{self.state.value.lower()}; retry shortly"
        )

    async def _launch(self) -> protocol.Loaded:
        parent, child = socket.socketpair()
        # Segments travel as descriptors, one per datagram (message boundaries kept).
        segments, segments_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        segments.setblocking(False)
        if self._segment_channel is not None:
            self._segment_channel.close()
        self._segment_channel = segments
        self._sent = set()
        python = self.spec.python
        inherited = (
            {k: v for k, v in os.environ.items() if k in PYTHON_ENV_ALLOWED}
            if python
            else os.environ
        )
        env = {**inherited, "GLOG_minloglevel": "2", **self.spec.env}
        if python:
            # numpy's OpenBLAS would start its threads at import, before the sandbox, which
            # holds only for the thread that enters it (python_sandbox.py).
            env["OPENBLAS_NUM_THREADS"] = "1"
        # A Python model's prints go to the server's log, tagged with the model's name.
        output = asyncio.subprocess.PIPE if python else asyncio.subprocess.DEVNULL
        try:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "service.workers.main",
                "--fd",
                str(child.fileno()),
                "--segments-fd",
                str(segments_child.fileno()),
                pass_fds=(child.fileno(), segments_child.fileno()),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=output,
                stderr=output if python else None,
                env=env,
            )
        finally:
            child.close()
            segments_child.close()
        for stream in (self._process.stdout, self._process.stderr):
            if stream is not None:
                task = asyncio.create_task(_forward_output(stream, self.spec.model_name))
                self._output_tasks.add(task)
                task.add_done_callback(self._output_tasks.discard)
        self.pid = self._process.pid
        self._started_at = time.monotonic()
        self._answered = 0
        self._killed_hung = False
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        self._writer = writer
        files = self.spec.files
        writer.write(
            protocol.encode(
                Load(
                    self.spec.model_name,
                    files.version,
                    str(files.model_file),
                    str(files.params_file),
                    dict(self.spec.parameters),
                    self.spec.device,
                    self.spec.shapes,
                    self.spec.backend,
                    self.spec.config,
                )
            )
        )
        try:
            first = await asyncio.wait_for(_read_message(reader), LOAD_TIMEOUT_S)
        except TimeoutError:
            first = protocol.LoadFailed(f"loading took longer than {LOAD_TIMEOUT_S:.0f} s")
        if not isinstance(first, protocol.Loaded):
            writer.close()
            if self._process.returncode is None:
                self._process.kill()
            code = await self._process.wait()
            reason = (
                first.reason
                if isinstance(first, protocol.LoadFailed)
                else f"worker exited ({code})"
            )
            raise RuntimeError(reason)
        self.state = State.READY
        self._ready.set()
        self._attempted.set()
        self._reader_task = asyncio.create_task(self._read_loop(reader, writer))
        return first

    async def _read_loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                message = await _read_message(reader)
                if message is None:
                    break
                if isinstance(message, protocol.Result | protocol.Failed):
                    self._complete(message)
        except ConnectionError as exc:
            log.warning("worker %s: %s", self.spec.instance_name, exc)
        except Exception as exc:
            # A Python model can write anything to its socket: whatever breaks the protocol
            # (a class the unpickler refuses, a field of the wrong type) ends that worker,
            # never the front-end.
            log.warning(
                "worker %s broke the protocol (%r); killing it", self.spec.instance_name, exc
            )
            if self._process is not None and self._process.returncode is None:
                self._process.kill()
        finally:
            writer.close()
        if self.state is not State.STOPPED:
            await self._on_death()

    def _complete(self, message: protocol.Result | protocol.Failed) -> None:
        pending = self._pending.pop(message.request_id, None)
        if pending is None:
            return
        self._answered += 1
        self._watch_oldest()
        try:
            if isinstance(message, protocol.Failed):
                # Paddle's InvalidArgument/OutOfRange errors are about the request's values
                # (e.g. embedding ids out of range), which validation cannot see.
                bad_input = any(k in message.message for k in _BAD_INPUT_ERRORS)
                outcome: InferResult | errors.ServiceError = (
                    errors.invalid if bad_input else errors.internal
                )(f"model '{self.spec.model_name}' failed: {message.message}")
            else:
                outcome = self._split(pending, message)
        finally:
            self._free.put_nowait(pending.slot)
        if pending.future.done():
            return
        if isinstance(outcome, errors.ServiceError):
            pending.future.set_exception(outcome)
        else:
            pending.future.set_result(outcome)

    def _split(
        self, pending: _Pending, message: protocol.Result
    ) -> InferResult | errors.ServiceError:
        """Each request's outputs, copied out of the slot before it is handed on."""
        views = pending.slot.read(message, self._served_names, self._datatypes)
        try:
            return InferResult(pending.batch.split(views), message.timings, pending.queue_ns)
        except errors.ServiceError as exc:
            return exc
        finally:
            for view in views:
                if isinstance(view.data, memoryview):
                    view.data.release()

    def _watch_oldest(self) -> None:
        """Time the request the worker is running now: the oldest it holds."""
        oldest = next(iter(self._pending), None)
        if oldest == self._watched:
            return
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._watched = oldest
        if oldest is not None and self.execution_timeout_s is not None:
            self._watchdog = asyncio.get_running_loop().call_later(
                self.execution_timeout_s, self._kill_hung, oldest
            )

    def _kill_hung(self, request_id: int) -> None:
        self._watchdog = None
        process = self._process
        if request_id not in self._pending or process is None or process.returncode is not None:
            return
        log.error(
            "worker %s (pid %d) has run one batch for more than %.1f s (execution_timeout_ms); "
            "killing it",
            self.spec.instance_name,
            self.pid,
            self.execution_timeout_s,
        )
        self._killed_hung = True
        process.kill()

    async def _on_death(self) -> None:
        self.state = State.RESTARTING
        self._ready.clear()
        self._attempted.clear()
        self._writer = None
        code = await self._process.wait() if self._process else None
        if self._killed_hung:
            how = f"was killed by the watchdog after {self.execution_timeout_s:.1f} s"
        elif code is not None and code < 0:
            how = f"was killed by signal {-code}"
        else:
            how = f"exited ({code})"
        log.error(
            "worker %s (pid %d) %s; %d request(s) in it go back to the queue; restarting",
            self.spec.instance_name,
            self.pid,
            how,
            len(self._pending),
        )
        message = (
            f"the worker process for model '{self.spec.model_name}' {how} while holding this "
            "request; it is being restarted"
        )
        self._fail_pending(lambda index: WorkerDied(message, running=index == 0))
        # Back off only for a worker that keeps dying young without answering anything (a
        # crash loop); one that was serving comes back at once.
        lived = time.monotonic() - self._started_at
        self._restart_delay = (
            0.0
            if lived > MAX_RESTART_DELAY_S or self._answered
            else min(max(1.0, self._restart_delay * 2), MAX_RESTART_DELAY_S)
        )
        self._restart_task = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        while self.state is State.RESTARTING:
            await asyncio.sleep(self._restart_delay)
            try:
                await self._launch()
            except (RuntimeError, OSError, TimeoutError) as exc:
                self._restart_delay = min(max(1.0, self._restart_delay * 2), MAX_RESTART_DELAY_S)
                self.start_failure = str(exc)
                self._attempted.set()
                log.error("restarting worker %s failed: %s", self.spec.instance_name, exc)
                continue
            self.start_failure = None
            self.restarts += 1
            log.info("worker %s restarted (pid %d)", self.spec.instance_name, self.pid)

    def _fail_pending(self, error: Callable[[int], errors.ServiceError]) -> None:
        """Fail what the worker held; `error` gets each request's place in the worker's line
        (0: the one it was running)."""
        pending, self._pending = self._pending, {}
        self._watch_oldest()
        for index, entry in enumerate(pending.values()):
            self._free.put_nowait(entry.slot)
            if not entry.future.done():
                entry.future.set_exception(error(index))


async def _forward_output(stream: asyncio.StreamReader, model: str) -> None:
    """Each line a Python model's worker prints, into the server's log (bounded per line)."""
    pending = b""
    while chunk := await stream.read(1 << 16):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > MAX_LOG_LINE:
            lines.append(pending)
            pending = b""
        for line in lines:
            model_log.info("model %s: %s", model, line.decode(errors="replace")[:MAX_LOG_LINE])
    if pending:
        model_log.info("model %s: %s", model, pending.decode(errors="replace")[:MAX_LOG_LINE])


async def _read_message(reader: asyncio.StreamReader) -> protocol.Message | None:
    try:
        header = await reader.readexactly(protocol.header_size())
        body = await reader.readexactly(protocol.body_size(header))
    except asyncio.IncompleteReadError:
        return None
    return protocol.decode(body)


async def _until(awaitable: Awaitable[_T], deadline: float | None, message: str) -> _T:
    if deadline is None:
        return await awaitable
    remaining = deadline - asyncio.get_running_loop().time()
    try:
        return await asyncio.wait_for(awaitable, max(remaining, 0.0))
    except TimeoutError:
        raise errors.deadline_exceeded(message) from None
