"""The front-end's side of the decoupled requests one worker holds (protocol.Submit): each
request's responses wait until its caller takes them, at most RESPONSE_WINDOW of them (the
worker's credit: a worker that sends more broke the protocol), a Credit goes back for those
taken (half a window at a time), a Cancel when the caller goes away, and the worker's death
ends each request the way its caller can act on: one that had no response yet may run again
(WorkerDied), one that had some fails UNAVAILABLE saying how many were delivered.

`ResponseLine` is the pure bookkeeping; `StreamRequest` drives it on the event loop."""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import grpc

from service.inference import errors
from service.inference.credit import ReturnedCredit
from service.inference.errors import WorkerDied
from service.inference.jobs import InferJob, InputTensor, OutputTensor, StreamAnswer
from service.inference.timers import fail_at
from service.workers import protocol, results
from service.workers.results import Outputs


def inline(
    tensors: Sequence[InputTensor | OutputTensor],
) -> tuple[tuple[protocol.TensorRef, ...], bytes]:
    """Tensors as a message carries them (a Submit's inputs, a BLS answer's outputs): one
    buffer, and where each lies in it."""
    refs, offset = [], 0
    for tensor in tensors:
        nbytes = len(tensor.data)
        refs.append(
            protocol.TensorRef(tensor.name, tensor.datatype.numpy.str, tensor.shape, offset, nbytes)
        )
        offset += nbytes
    return tuple(refs), b"".join(tensor.data for tensor in tensors)


class CreditExceeded(Exception):
    """The worker sent a request more responses than it had credit for."""


class ResponseLine:
    """One request's responses between the worker and the caller; the credit for those taken
    goes back half a window at a time (ReturnedCredit)."""

    def __init__(self, window: int = protocol.RESPONSE_WINDOW) -> None:
        self.credit = ReturnedCredit(window)
        self._waiting: deque[protocol.Response] = deque()
        self.received = 0
        self.taken = 0
        self.final_received = False

    def push(self, response: protocol.Response) -> None:
        """A response from the worker; CreditExceeded when the worker had no credit left, or
        the request had ended."""
        if self.final_received:
            raise CreditExceeded(f"a response after the final one of request {response.request_id}")
        # A final response needs no credit (a flags-only final must get through a full window).
        if not response.final and not self.credit.allows(len(self._waiting)):
            raise CreditExceeded(
                f"more than {self.credit.window} responses of request {response.request_id} "
                "not credited"
            )
        self._waiting.append(response)
        self.received += 1
        self.final_received = response.final

    def take(self) -> tuple[protocol.Response | None, int]:
        """The oldest response the caller has not taken, and the credit to give back now."""
        if not self._waiting:
            return None, 0
        self.taken += 1
        response = self._waiting.popleft()
        return response, 0 if response.final else self.credit.took()

    @property
    def finished(self) -> bool:
        """The final response was received and taken."""
        return self.final_received and not self._waiting


class StreamRequest:
    """One decoupled request in one worker, as its caller sees it."""

    def __init__(
        self,
        request_id: int,
        model: str,
        outputs: Outputs,
        send: Callable[[protocol.Message], None],
        forget: Callable[[int], None],
    ) -> None:
        self.request_id = request_id
        self.line = ResponseLine()
        self._model = model
        self._outputs = outputs
        self._send = send
        self._forget = forget
        self._wake: asyncio.Future[None] | None = None
        self._died: str | None = None  # how the worker ended, if it did
        self._retry = True  # whether a request with no response yet may run again
        self._blamed = True  # whether the death counts against the request (poison)
        self._closed = False

    def deliver(self, response: protocol.Response) -> None:
        self.line.push(response)
        self._wakeup()

    def died(self, how: str, retry: bool = True, blamed: bool = True) -> None:
        self._died = how
        self._retry = retry
        self._blamed = blamed
        self._wakeup()

    def _wakeup(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def next(self, deadline: float | None, gap_s: float | None) -> StreamAnswer | None:
        """The next response, None once the final one was taken. Raises DEADLINE_EXCEEDED at
        `deadline`, INTERNAL when the model, with credit to send, sends nothing for `gap_s`
        (execution_timeout_ms), and the worker's death as the docstring above says."""
        loop = asyncio.get_running_loop()
        while True:
            response, credit = self.line.take()
            if response is not None:
                if credit:
                    self._send(protocol.Credit(self.request_id, credit))
                return self._answer(response)
            if self.line.final_received:
                return None
            if self._died is not None:
                raise self._death()
            self._wake = loop.create_future()
            # One timer, at the earlier of the two limits, which says at firing which passed:
            # a wait per response, so a second timer is CPU per token.
            gap_end = None if gap_s is None else loop.time() + gap_s
            at = min((t for t in (deadline, gap_end) if t is not None), default=None)
            error = functools.partial(self._timed_out, deadline, gap_end, gap_s)
            timer = fail_at(self._wake, at, error)
            try:
                await self._wake
            finally:
                self._wake = None
                if timer is not None:
                    timer.cancel()

    def _timed_out(
        self, deadline: float | None, gap_end: float | None, gap_s: float | None
    ) -> errors.ServiceError:
        """The error of the limit that passed first: the deadline where both are at once."""
        if deadline is not None and (gap_end is None or deadline <= gap_end):
            return errors.deadline_exceeded(
                f"the request's deadline passed after {self.line.taken} response(s)"
            )
        return errors.internal(
            f"model '{self._model}' sent no response for {gap_s:.1f} s "
            f"(execution_timeout_ms) after {self.line.taken} response(s); the "
            "request was cancelled"
        )

    def _death(self) -> errors.ServiceError:
        message = (
            f"the worker process for model '{self._model}' {self._died} while running this request"
        )
        if self.line.received == 0 and self._retry:
            return WorkerDied(f"{message}; it is being restarted", running=self._blamed)
        if self.line.received == 0:
            return errors.internal(f"{message}; the request is not run again")
        return errors.unavailable(
            f"{message}, after {self.line.taken} response(s) were delivered; the rest are lost"
        )

    def _answer(self, response: protocol.Response) -> StreamAnswer:
        try:
            outputs = self._outputs.response(response)
        except errors.ServiceError as exc:
            return StreamAnswer((), response.final, exc.message)
        status = results.TRITON_STATUS.get(response.error_code, grpc.StatusCode.INTERNAL)
        return StreamAnswer(outputs, response.final, response.error, status.name)

    def close(self) -> None:
        """The caller is done: a request the model has not finished is cancelled in it."""
        if self._closed:
            return
        self._closed = True
        self._forget(self.request_id)
        if not self.line.final_received and self._died is None:
            self._send(protocol.Cancel(self.request_id))


class Streams:
    """The decoupled requests one worker holds (of the process that holds their calls)."""

    def __init__(self, on_response: Callable[[], None] | None = None) -> None:
        self._requests: dict[int, StreamRequest] = {}
        self.on_response = on_response  # each data response the model sent (metrics)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[StreamRequest]:
        return iter(list(self._requests.values()))

    def start(
        self,
        request_id: int,
        model: str,
        outputs: Outputs,
        send: Callable[[protocol.Message], None],
        job: InferJob,
        caller_id: str,
        parameters: str,
    ) -> StreamRequest:
        """One request sent to the worker (`send`), its handle returned."""
        request = StreamRequest(request_id, model, outputs, send, self.forget)
        self._requests[request_id] = request
        refs, data = inline(job.inputs)
        asked = outputs.fetch_names(job.outputs)
        send(protocol.Submit(request_id, refs, data, asked, caller_id, parameters))
        return request

    def forget(self, request_id: int) -> None:
        self._requests.pop(request_id, None)

    def deliver(self, response: protocol.Response) -> None:
        """From the worker's socket; CreditExceeded ends the worker (a protocol breach). A
        response of a request already closed (cancelled) is dropped."""
        if response.outputs and response.error is None and self.on_response is not None:
            self.on_response()
        request = self._requests.get(response.request_id)
        if request is not None:
            request.deliver(response)

    def died(self, how: str, retry: bool = True, blamed: bool = True) -> None:
        """The worker ended; `retry`: a request it had sent nothing for may run again (False
        when the worker was killed for breaking the protocol); `blamed`: the death counts
        against its requests (False when the server ended it)."""
        requests, self._requests = self._requests, {}
        for request in requests.values():
            request.died(how, retry, blamed)
