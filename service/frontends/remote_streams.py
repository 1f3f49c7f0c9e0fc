"""A front-end's own socket to one decoupled worker (the worker's side: decoupled_loop.py): the
front-end sends its requests there and reads their responses itself, so no token crosses the
parent. The parent tells it the worker's launches and deaths (WORKER, as for queues); for each
launch it makes a socket pair and passes one end to the parent, which hands it to that worker
(AddProducer) if the launch still serves.

What the worker sends is input: a message larger than a response may be, one that cannot be
read, one that is not a Response, or more responses than the request's credit, fails this
process's requests in it for good and has the parent end the worker (TROUBLE), as the parent
ends a worker that breaks its own socket's protocol."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
from collections.abc import Callable
from typing import Any

from service.inference import errors
from service.inference.jobs import InferJob
from service.workers import deaths, launch, message_bounds, protocol, streams
from service.workers.results import Outputs
from service.workers.streams import StreamRequest
from service.workers.worker_process import READY_WAIT_S, State

log = logging.getLogger("paddlequic.frontend")

# attach(launch, [its end]): this process's socket for that launch, to the parent for the worker;
# trouble(launch, reason): the worker broke the protocol on it.
Attach = Callable[[int, list[int]], None]
Trouble = Callable[[int, str], None]


class RemoteWorker:
    """One instance's worker as the parent describes it to a front-end (QUEUED): its launch
    now, its state, its NUMA node and execution timeout."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._numa = int(data["numa"])
        timeout = data["timeout"]
        self.execution_timeout_s = None if timeout is None else float(timeout)
        self.launch = int(data["launch"])
        self.state = State.READY if data["ready"] else State.STARTING
        self.start_failure: str | None = data["failure"]

    @property
    def numa_node(self) -> int:
        return self._numa

    def told(self, event: dict[str, Any]) -> None:
        """What the parent says the worker did (WORKER), kept, then acted on."""
        kind = event.get("event")
        if kind == "ready":
            self.launch, self.state, self.start_failure = int(event["launch"]), State.READY, None
            self.launched()
        elif kind == "ended":
            self.state = State.RESTARTING
            fate = deaths.Fate(event["fate"])
            if held := self.held():
                # The parent's line counts only its own requests: this process says its own.
                log.error(
                    "worker %s %s; %d request(s) in it %s (held by this front-end)",
                    event.get("worker", "?"),
                    event["how"],
                    held,
                    fate.value,
                )
            self.ended(deaths.Death(str(event["how"]), fate, bool(event["blamed"])))
        elif kind == "failed":
            self.start_failure = str(event["failure"])
            self.start_failed()

    def held(self) -> int:
        """The requests this process holds in the launch serving."""
        return 0

    def launched(self) -> None:
        """A new launch serves."""

    def ended(self, death: deaths.Death) -> None:
        """The launch serving died."""

    def start_failed(self) -> None:
        """A restart failed."""


class RemoteStreams(RemoteWorker):
    """One instance of a decoupled version as a front-end serves it: what streaming.py picks
    (state, outstanding, numa_node, execution_timeout_s) and submits to."""

    def __init__(
        self,
        model: str,
        data: dict[str, Any],
        outputs: Outputs,
        max_message: int,
        attach: Attach,
        trouble: Trouble,
    ) -> None:
        super().__init__(data)
        self._model = model
        self.streams = streams.Streams()
        self._outputs = outputs
        self._largest = message_bounds.largest_message(
            message_bounds.Holding(loaded=True, decoupled=True, bls=False), max_message
        )
        self._attach = attach
        self._trouble = trouble
        self._ids = itertools.count(1)
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()  # a launch connected, ended or failed to start
        if self.state is State.READY:
            self._connect()

    @property
    def outstanding(self) -> int:
        return len(self.streams)

    def held(self) -> int:
        return self.outstanding

    async def submit(self, job: InferJob, caller_id: str, parameters: str) -> StreamRequest:
        """As WorkerInstance.submit: waits (bounded) for a launch to serve."""
        loop = asyncio.get_running_loop()
        until = loop.time() + READY_WAIT_S
        while self._writer is None:
            if self.state is State.STOPPED or self.start_failure is not None:
                failure = f": {self.start_failure}" if self.start_failure else ""
                raise errors.unavailable(f"{self._not_ready()}{failure}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(until - loop.time(), 0))
            if loop.time() >= until and self._writer is None:
                raise errors.unavailable(self._not_ready())
        return self.streams.start(
            next(self._ids), self._model, self._outputs, self._send, job, caller_id, parameters
        )

    def _not_ready(self) -> str:
        return f"model '{self._model}' has no worker ready; retry shortly"

    def _send(self, message: protocol.Message) -> None:
        if self._writer is not None:
            self._writer.write(protocol.encode(message))

    def launched(self) -> None:
        self._ended(deaths.Death("was replaced", deaths.Fate.REQUEUE, False))
        self._connect()
        self._changed.set()

    def ended(self, death: deaths.Death) -> None:
        self._ended(death)
        self._changed.set()

    def start_failed(self) -> None:
        self._changed.set()

    def _connect(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._attach(self.launch, [theirs.fileno()])
        finally:
            theirs.close()
        self._reading = asyncio.get_running_loop().create_task(self._read(mine, self.launch))

    async def _read(self, sock: socket.socket, launch_number: int) -> None:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        if self.launch != launch_number or self.state is not State.READY:
            writer.close()
            return
        self._writer = writer
        self._changed.set()
        try:
            while (message := await launch.read_message(reader, lambda: self._largest)) is not None:
                if not isinstance(message, protocol.Response):
                    raise ValueError(f"a {type(message).__name__} on a front-end's socket")
                self.streams.deliver(message)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception as exc:
            # Whatever breaks the protocol (a header declaring more than a response may be,
            # a class the unpickler refuses, more responses than credit) ends that worker.
            reason = f"sent {exc}" if isinstance(exc, protocol.Oversized) else repr(exc)
            log.error("a worker of model '%s' broke the protocol: %s", self._model, reason)
            self._trouble(launch_number, reason)
            if self.launch == launch_number:
                self._ended(deaths.Death(f"broke the protocol ({reason})", deaths.Fate.FAIL, True))
        finally:
            writer.close()
            if self._writer is writer:  # closed by the worker's side: no more requests on it
                self._writer = None

    def _ended(self, death: deaths.Death) -> None:
        """This launch is over: the requests it held end as its death's fate says."""
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None
        self._writer = None
        self.streams.died(death.how, death.fate is deaths.Fate.REQUEUE, death.blamed)

    def stop(self) -> None:
        self.state = State.STOPPED
        self.ended(deaths.Death("stopped (this process let the model go)", deaths.Fate.FAIL, False))
