"""The server's side of the BLS calls one worker's model makes (protocol.BlsCall): each runs
as a task through the request path (the Handler the lifecycle gives the instance), with the
calling batch's chain of calls and deadline, at most BLS_MAX_IN_FLIGHT at once. A decoupled
call's responses go to the worker each as the target sends it (a BlsAnswer with `more`). While
the worker lives every call ends with exactly one BlsAnswer without `more`, a cancelled one
too, so that the model's exec() always returns and its iterator always ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from oip.datatypes import from_numpy
from service.inference import errors
from service.inference.calls import CallChain
from service.inference.jobs import InputTensor, OutputTensor, StreamAnswer
from service.workers import protocol
from service.workers.results import triton_code
from service.workers.streams import inline

log = logging.getLogger("paddlequic.worker")
BLS_MAX_IN_FLIGHT = 16
# Of one decoupled call, and their bytes protocol.BLS_MAX_BYTES in all: what the worker may have
# to hold of a call whose responses its model does not take.
BLS_MAX_RESPONSES = 1024


@dataclass(frozen=True)
class ModelCall:
    """One BLS call as the request path runs it."""

    instance: int  # the calling instance (its id, as in CallChain.waiting)
    model: str
    version: str  # "": the newest ready version
    inputs: tuple[InputTensor, ...]
    outputs: tuple[str, ...]
    chain: CallChain
    deadline: float | None  # event-loop time
    decoupled: bool = False  # exec(decoupled=True): every response the target answers


class Handler(Protocol):
    """Runs a call through the request path (service/serving/bls.py); a ServiceError for one
    that fails."""

    async def infer(self, call: ModelCall) -> tuple[OutputTensor, ...]:
        """exec(): the target's outputs."""

    def responses(self, call: ModelCall) -> AsyncGenerator[StreamAnswer, None]:
        """exec(decoupled=True): the target's responses as it sends them."""


@dataclass(frozen=True)
class Caller:
    """What the instance knows of the batch that made a call."""

    chain: CallChain
    deadline: float | None
    execution_timeout_s: float | None  # the watchdog's limit: a call's deadline if none is set


class BlsCalls:
    """The BLS calls of one worker instance. `changed` is called whenever the calls a batch
    has out change (the instance's watchdog stops a batch's clock while it waits on them)."""

    def __init__(
        self, instance: int, send: Callable[[protocol.Message], None], changed: Callable[[], None]
    ) -> None:
        self.handler: Handler | None = None  # set by the lifecycle once the version is loaded
        self._instance = instance
        self._send = send
        self._changed = changed
        self._calls: dict[int, tuple[int, asyncio.Task[None]]] = {}  # id -> caller, its task
        self._withdrawn: set[int] = set()  # calls the model cancelled itself

    def __len__(self) -> int:
        return len(self._calls)

    def waiting(self, caller: int) -> bool:
        """Whether the batch `caller` has calls out."""
        return any(c == caller for c, _ in self._calls.values())

    def start(self, message: protocol.BlsCall, caller: Caller | None) -> None:
        """Run the call, or answer it at once with why it cannot run."""
        call_id = message.call_id
        if caller is None:
            self._refuse(
                call_id, "the request that made this BLS call has ended", grpc.StatusCode.CANCELLED
            )
            return
        if self.handler is None:
            self._refuse(call_id, "this model cannot make BLS calls", grpc.StatusCode.UNIMPLEMENTED)
            return
        if len(self._calls) >= BLS_MAX_IN_FLIGHT:
            self._refuse(
                call_id,
                f"the instance has {BLS_MAX_IN_FLIGHT} BLS calls in flight, the most it may",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
            return
        try:
            inputs = call_inputs(message)
        except errors.ServiceError as exc:
            self._refuse(call_id, exc.message, exc.code)
            return
        call = ModelCall(
            self._instance,
            message.model,
            message.version,
            inputs,
            message.outputs,
            caller.chain.called_from(self._instance),
            call_deadline(asyncio.get_running_loop().time(), message.timeout_us, caller),
            message.decoupled is True,
        )
        task = asyncio.create_task(self._run(call_id, self.handler, call))
        self._calls[call_id] = (message.caller, task)
        self._changed()

    def cancel(self, caller: int) -> None:
        """The batch `caller` ended: its calls still out are cancelled (and answered so)."""
        for made_by, task in list(self._calls.values()):
            if made_by == caller:
                task.cancel()

    def withdraw(self, call_id: int) -> None:
        """The model cancelled its call (ResponseIterator.cancel()); one already ended, or
        never made, is no error."""
        call = self._calls.get(call_id)
        if call is not None:
            self._withdrawn.add(call_id)
            call[1].cancel()

    def cancel_all(self) -> None:
        """The worker is gone or stopping."""
        for _, task in list(self._calls.values()):
            task.cancel()

    async def _run(self, call_id: int, handler: Handler, call: ModelCall) -> None:
        answer: protocol.BlsAnswer
        try:
            if call.decoupled:
                await self._stream(call_id, handler, call)
                answer = protocol.BlsAnswer(call_id, (), b"", parts=())
            else:
                answer = _answer(call_id, call.model, await handler.infer(call))
        except errors.ServiceError as exc:
            answer = _error(call_id, exc.message, exc.code)
        except asyncio.CancelledError:
            message = (
                "cancelled: the model cancelled this BLS call"
                if call_id in self._withdrawn
                else "cancelled: the request that made this BLS call ended"
            )
            answer = _error(call_id, message, grpc.StatusCode.CANCELLED)
        except Exception as exc:  # a bug here must not leave the model waiting forever
            log.exception("BLS call to model %r failed", call.model)
            answer = _error(call_id, f"internal error: {exc}", grpc.StatusCode.INTERNAL)
        finally:
            self._calls.pop(call_id, None)
            self._withdrawn.discard(call_id)
            self._changed()
        self._send(answer)

    async def _stream(self, call_id: int, handler: Handler, call: ModelCall) -> None:
        """Each response to the worker as it comes, at most BLS_MAX_RESPONSES and
        BLS_MAX_BYTES of outputs, else the call fails and the target's request is cancelled."""
        count = size = 0
        async with contextlib.aclosing(handler.responses(call)) as responses:
            async for response in responses:
                count += 1
                size += sum(len(t.data) for t in response.outputs)
                if count > BLS_MAX_RESPONSES or size > protocol.BLS_MAX_BYTES:
                    raise errors.ServiceError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"model '{errors.echoed(call.model)}' answered the decoupled BLS call "
                        f"with more than {BLS_MAX_RESPONSES} responses or "
                        f"{protocol.BLS_MAX_BYTES} bytes of outputs, the most one call may "
                        "hand its model",
                    )
                self._send(_part(call_id, response))

    def _refuse(self, call_id: int, message: str, status: grpc.StatusCode) -> None:
        self._send(_error(call_id, message, status))


def call_inputs(message: protocol.BlsCall) -> tuple[InputTensor, ...]:
    """The call's input tensors; INVALID_ARGUMENT for one the worker described wrong."""
    tensors = []
    for ref in message.inputs:
        try:
            datatype = from_numpy(np.dtype(ref.dtype))
        except (TypeError, ValueError):
            raise errors.invalid(
                f"BLS input {errors.echoed(ref.name)!r} has dtype {errors.echoed(ref.dtype)!r}, "
                "which has no protocol datatype"
            ) from None
        data = message.data[ref.offset : ref.offset + ref.nbytes]
        if ref.offset < 0 or len(data) != ref.nbytes:
            raise errors.invalid(f"BLS input {errors.echoed(ref.name)!r} lies outside the call")
        tensors.append(InputTensor(ref.name, datatype, tuple(ref.shape), data))
    return tuple(tensors)


def call_deadline(now: float, timeout_us: int, caller: Caller) -> float | None:
    """The sooner of the call's own timeout and its caller's deadline; with neither, the
    caller's execution limit (so that a call that can never run still ends)."""
    own = now + timeout_us / 1e6 if timeout_us > 0 else None
    limits = [t for t in (caller.deadline, own) if t is not None]
    if limits:
        return min(limits)
    if caller.execution_timeout_s is None:
        return None
    return now + caller.execution_timeout_s


def _answer(call_id: int, model: str, outputs: tuple[OutputTensor, ...]) -> protocol.BlsAnswer:
    """The outputs inline."""
    refs, data = inline(outputs)
    if len(data) > protocol.BLS_MAX_BYTES:
        message = (
            f"the answer of model '{model}' holds {len(data)} bytes of outputs; "
            f"at most {protocol.BLS_MAX_BYTES} may travel back in one BLS call"
        )
        return _error(call_id, message, grpc.StatusCode.RESOURCE_EXHAUSTED)
    return protocol.BlsAnswer(call_id, refs, data)


def _part(call_id: int, response: StreamAnswer) -> protocol.BlsAnswer:
    """One response of a decoupled call, more to come (its bytes bounded by the caller)."""
    refs, data = inline(response.outputs)
    code = triton_code(grpc.StatusCode[response.status]) if response.error is not None else 1
    part = protocol.BlsPart(refs, response.error, code)
    return protocol.BlsAnswer(call_id, (), data, parts=(part,), more=True)


def _error(call_id: int, message: str, status: grpc.StatusCode) -> protocol.BlsAnswer:
    return protocol.BlsAnswer(call_id, (), b"", message, triton_code(status))
