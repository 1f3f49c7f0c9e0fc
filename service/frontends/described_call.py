"""A ModelInfer call a front-end described, in the parent: a plain object, with no task and no
servicer context. When its frame arrives it is observed, access-checked, checked again and
queued in one step; its answer's future, once done, puts the answer and its status on the link
and records the call. The request path's deadline timer is its only one; a CANCEL frame (or
the front-end's loss) cancels the future. Observation and the access check are the functions
the wrapped servicers' calls run, so metrics, logs and traces cannot tell the two apart."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc

from service.api.restricted import Restriction
from service.frontends.descriptors import (
    MODEL_INFER,
    DescribedAnswer,
    DescribedRequest,
    encode_answer,
)
from service.frontends.placed_here import PlacedTensors
from service.frontends.protocol import (
    Kind,
    Metadata,
    Open,
    ProtocolViolation,
    Status,
    encode_status,
)
from service.inference import errors
from service.inference.jobs import Answer, InferJob, OutputTensor
from service.inference.validation import Decoding
from service.observability.observer import Observation, Observer, Within, deadline_passed
from service.registry.versions import ServedVersion
from service.serving.requests import RequestRunner

log = logging.getLogger("paddlequic.frontends")
_T = TypeVar("_T")
# Most calls end OK: their STATUS payload is made once.
_OK = encode_status(Status(grpc.StatusCode.OK, "", ()))


class Answering(Protocol):
    """The link a described call came on."""

    def send(self, kind: Kind, call_id: int, payload: bytes = b"") -> None: ...

    def flush_large(self) -> None: ...

    def ended(self, call_id: int) -> None: ...


@dataclass(frozen=True)
class Serving:
    """What every described call is served with."""

    runner: RequestRunner
    observer: Observer
    restriction: Restriction | None  # ModelInfer's (--restricted-protocol inference:...)
    max_message: int


class DescribedCall:
    """One described call, from its INFER frame to its STATUS (or its cancel)."""

    # Where its outputs that go to shared-memory regions are written, in a front-end that
    # holds copies of them (placed_here.py); they come back with no data.
    placed: PlacedTensors | None = None

    def __init__(
        self,
        link: Answering,
        call_id: int,
        opened: Open,
        served: ServedVersion,
        request: DescribedRequest,
        serving: Serving,
        within: Observation | None = None,
    ) -> None:
        """`served`: the version the front-end validated `request` against, still serving;
        `within`: the call it is a request of (a stream's), recorded as a whole, not it."""
        self.link = link
        self.call_id = call_id
        self.opened = opened
        self.served = served
        self.request = request
        self.serving = serving
        self.cancelled = False
        self._loop = asyncio.get_running_loop()
        self._deadline = None if opened.timeout is None else self._loop.time() + opened.timeout
        self._waiting: asyncio.Future[Any] | None = None  # what cancelling abandons
        self._answering = served
        self._started = time.perf_counter_ns()
        self.observation: Observation | Within = (
            Observation(serving.observer, opened.transport, MODEL_INFER, self._metadata)
            if within is None
            else Within(within)
        )
        self.observation.saw(request)

    def _metadata(self) -> Metadata:
        return self.opened.metadata

    def start(self) -> None:
        """Access-checked, then checked again with the version's own validator (what the
        front-end sent must be what it validated; a refusal counts as one of the version's
        failures, as the servicer's does), then queued: all before this returns, unless its
        decoding is heavy enough for a thread."""
        with self.observation.current():
            try:
                restriction = self.serving.restriction
                if restriction is not None and not restriction.allows(self.opened.metadata):
                    raise errors.ServiceError(grpc.StatusCode.UNAUTHENTICATED, restriction.refusal)
                if self.request.job is not None:  # validated by this very process
                    self._submit(self.request.job)
                    return
                decoding = self._refused_counted(self._checked)
                if not decoding.inline:
                    waiting = asyncio.ensure_future(asyncio.to_thread(decoding.finish))
                    waiting.add_done_callback(self._decoded)
                    self._waiting = waiting
                    return
                self._submit(self._refused_counted(decoding.finish))
            except Exception as exc:
                self._end(exc)

    def _checked(self) -> Decoding:
        request, validator = self.request, self.served.validator
        assert validator is not None
        return validator.check(request.inputs, request.outputs, request.priority, request.timeout_s)

    def _refused_counted(self, step: Callable[[], _T]) -> _T:
        """`step()`; a refusal counts as one of the version's failures."""
        try:
            return step()
        except errors.ServiceError:
            self.served.stats.record_failure(time.perf_counter_ns() - self._started)
            raise

    def received(self, kind: Kind, payload: bytes) -> None:
        if kind is Kind.CANCEL:
            self.cancel()
        elif kind is not Kind.CREDIT:  # credit means nothing to a call that came whole
            raise ProtocolViolation(f"{kind.name} frame for a described call")

    def cancel(self) -> None:
        """The client is gone (or its front-end): the request is abandoned, unanswered."""
        self.cancelled = True
        if self._waiting is not None:
            self._waiting.cancel()

    def _decoded(self, waiting: asyncio.Future[InferJob]) -> None:
        """A job decoded in a thread (its shapes declare much per-element work)."""
        with self.observation.current():
            try:
                self._submit(self._refused_counted(waiting.result))
            except BaseException as exc:
                self._end(exc)

    def _submit(self, job: InferJob) -> None:
        self._answering, answer = self.serving.runner.submit(self.served, job, self._deadline)
        answer.add_done_callback(self._answered)
        self._waiting = answer

    def _answered(self, answer: asyncio.Future[Answer]) -> None:
        if answer.cancelled():
            self._end(asyncio.CancelledError())
            return
        error = answer.exception()
        if error is not None:
            self._end(error)
            return
        answering = self._answering
        with self.observation.current():
            try:
                outputs = self._classified(answering, answer.result().outputs)
                if self.placed is not None:
                    outputs = self.placed.written(outputs)
                with self.serving.runner.encode_span():  # as the servicer's, its contents
                    described = DescribedAnswer(
                        answering.name,
                        str(answering.version),
                        self.request.id,
                        outputs,
                        answering is not self.served,
                    )
                    data = self.encode(described)
                if len(data) > self.serving.max_message:
                    raise oversized(len(data), self.serving.max_message)
            except Exception as exc:
                self._end(exc)
                return
        self._end(None, described, data)

    def _classified(
        self, answering: ServedVersion, outputs: tuple[OutputTensor, ...]
    ) -> tuple[OutputTensor, ...]:
        """The outputs the request asked classes of, as their top k (with the labels of the
        version that answered: a fallback's own), as the servicer's plane ranks them."""
        if not self.request.classes:
            return outputs
        return answering.classified(outputs, dict(self.request.classes))

    def encode(self, answer: DescribedAnswer) -> bytes:
        """The answer as the call's link carries it (to a front-end: a descriptor)."""
        return encode_answer(answer)

    def _end(
        self, error: BaseException | None, answer: DescribedAnswer | None = None, data: bytes = b""
    ) -> None:
        """Record the call and, unless it was cancelled, answer it."""
        self.link.ended(self.call_id)
        code, details = _outcome(error, self.opened.method)
        cancelled = self.cancelled or isinstance(error, asyncio.CancelledError)
        remaining = None if self._deadline is None else self._deadline - self._loop.time()
        observed = code
        if deadline_passed(remaining, cancelled):
            observed = grpc.StatusCode.DEADLINE_EXCEEDED
        logged = details if isinstance(error, errors.ServiceError) or error is None else repr(error)
        self.observation.end(observed, lambda: logged, answer)
        if self.cancelled:
            return
        if data:
            self.link.send(Kind.MESSAGE, self.call_id, data)
        status = _OK if error is None else encode_status(Status(code, details, ()))
        self.link.send(Kind.STATUS, self.call_id, status)
        self.link.flush_large()


def oversized(size: int, limit: int) -> errors.ServiceError:
    """An answer over the message limit (RESOURCE_EXHAUSTED, as grpc.aio refuses it)."""
    return errors.ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"response message of {size} bytes exceeds the limit of {limit} bytes",
    )


def _outcome(error: BaseException | None, method: str) -> tuple[grpc.StatusCode, str]:
    """The status a call that ended with `error` gets, as the dispatch endpoint gives it."""
    if error is None:
        return grpc.StatusCode.OK, ""
    if isinstance(error, errors.ServiceError):
        return error.code, error.message
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "Cancelled"
    log.error("unexpected error in %s", method, exc_info=error)
    return grpc.StatusCode.UNKNOWN, f"Unexpected {type(error)}: {error}"
