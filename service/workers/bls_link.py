"""A (non-decoupled) Python model's worker socket, so that its model can make BLS calls: a
thread reads every message the server sends, hands BLS answers to the calls waiting for them
(exec() blocks the execute thread; async_exec() is a future) and everything else to the main
loop in order; every send goes through one lock, as the model may call from threads of its
own. A decoupled call's future holds its iterator from the call's first answer on; each
response is put in it as it arrives.

The thread starts after the load: the Python sandbox was entered by the single-threaded
process, before model.py was imported."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from service.backend.python_runtime import triton_python_backend_utils as pb_utils
from service.queues import wakeups
from service.workers import protocol
from service.workers.message_bounds import bls_inline_bytes
from service.workers.tensor_io import inline_arrays, input_array

_Future = concurrent.futures.Future[pb_utils.InferenceResponse | pb_utils.ResponseIterator]
# A decoupled call's responses as its iterator takes them; None: the call has ended.
_Responses = queue.SimpleQueue[pb_utils.InferenceResponse | None]


class BlsLink:
    """The worker's socket and its model's BLS calls (pb_utils.ModelCaller)."""

    def __init__(
        self, sock: socket.socket, recv: Callable[[], protocol.Message | None], max_message: int
    ) -> None:
        self._sock = sock
        # More input bytes in one call and the front-end kills the worker (message_bounds.py).
        self._max_bytes = bls_inline_bytes(max_message)
        self._recv = recv
        self._send_lock = threading.Lock()
        self._inbox: queue.SimpleQueue[protocol.Message | None] = queue.SimpleQueue()
        # id -> future, a decoupled call's responses
        self._calls: dict[int, tuple[_Future, _Responses | None]] = {}
        self._calls_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        # The Infer the main loop runs now: the caller every BLS call is made for.
        self.caller = 0
        # Once the worker serves from its instance queues: what a BLS call is answered, and
        # the eventfd woken for each message the main loop may take (queued_loop.Inbox).
        self._refusal: str | None = None
        self._arrived: int | None = None
        threading.Thread(target=self._read, name="read", daemon=True).start()

    def recv(self) -> protocol.Message | None:
        """The main loop's next message; None once the server closed the socket."""
        return self._inbox.get()

    def queued(self, model: str) -> BlsLink:
        """The worker now serves from its instance queues (its config's
        python_instance_queues, or its code names no BLS call): its model's BLS calls are
        refused, and the main loop polls `fileno()` for messages."""
        self._refusal = (
            f"model '{model}' takes its requests through its instance queues, where it "
            "cannot make BLS calls: set parameter python_instance_queues to false in its "
            "config.pbtxt to make them"
        )
        self._arrived = wakeups.make()
        if not self._inbox.empty():  # come before the eventfd did
            wakeups.wake(self._arrived)
        return self

    def fileno(self) -> int:
        assert self._arrived is not None
        return self._arrived

    def take(self) -> list[protocol.Message | None]:
        """The messages waiting for the main loop, without blocking."""
        assert self._arrived is not None
        wakeups.clear(self._arrived)
        taken: list[protocol.Message | None] = []
        with contextlib.suppress(queue.Empty):
            while True:
                taken.append(self._inbox.get_nowait())
        return taken

    def send(self, message: protocol.Message) -> None:
        encoded = protocol.encode(message)
        with self._send_lock:
            self._sock.sendall(encoded)

    def submit(self, request: pb_utils.InferenceRequest, decoupled: bool) -> _Future:
        if self._refusal is not None:
            raise pb_utils.TritonModelException(self._refusal)
        arrays = [(t.name(), _wire_array(t.as_numpy())) for t in request.inputs()]
        refs, data = inline_arrays(arrays)
        if len(data) > self._max_bytes:
            raise pb_utils.TritonModelException(
                f"the BLS call to model '{request.model_name}' carries {len(data)} bytes of "
                f"inputs; at most {self._max_bytes} may travel in one call"
            )
        if not request.model_name:
            raise pb_utils.TritonModelException("a BLS call needs model_name")
        future: _Future = concurrent.futures.Future()
        call_id = next(self._ids)
        with self._calls_lock:
            if self._closed:
                raise pb_utils.TritonModelException("the server closed the worker's connection")
            self._calls[call_id] = (future, queue.SimpleQueue() if decoupled else None)
        version = "" if request.model_version < 0 else str(request.model_version)
        call = protocol.BlsCall(
            call_id,
            self.caller,
            request.model_name,
            version,
            refs,
            data,
            tuple(request.requested_output_names()),
            max(int(request.timeout()), 0),
            decoupled,
        )
        self.send(call)
        return future

    def _read(self) -> None:
        while True:
            try:
                message = self._recv()
            except (OSError, ValueError):
                message = None  # the connection broke: as if the server closed it
            if isinstance(message, protocol.BlsAnswer):
                self._answer(message)
                continue
            self._inbox.put(message)
            if self._arrived is not None:
                wakeups.wake(self._arrived)
            if message is None:
                break
        with self._calls_lock:
            self._closed = True
            calls, self._calls = self._calls, {}
        for call_id, (future, responses) in calls.items():
            self._end(
                call_id, future, responses, _error("the server closed the worker's connection")
            )

    def _answer(self, answer: protocol.BlsAnswer) -> None:
        with self._calls_lock:
            if answer.more:
                future, responses = self._calls.get(answer.call_id, (None, None))
            else:
                future, responses = self._calls.pop(answer.call_id, (None, None))
        if future is None:
            return
        if answer.error is not None:
            self._end(answer.call_id, future, responses, _error(answer.error, answer.error_code))
            return
        try:
            if responses is None:
                future.set_result(_response(answer.data, answer.outputs))
                return
            for p in answer.parts or ():
                responses.put(
                    _error(p.error, p.error_code)
                    if p.error is not None
                    else _response(answer.data, p.outputs)
                )
        except (ValueError, TypeError) as exc:
            if answer.more:  # the rest of the call is of no use: stopped and forgotten
                self._withdraw(answer.call_id)
                with self._calls_lock:
                    self._calls.pop(answer.call_id, None)
            error = _error(f"the BLS answer cannot be read ({exc})")
            self._end(answer.call_id, future, responses, error)
            return
        if not answer.more:
            responses.put(None)
        self._hand_over(answer.call_id, future, responses)

    def _end(
        self,
        call_id: int,
        future: _Future,
        responses: _Responses | None,
        response: pb_utils.InferenceResponse,
    ) -> None:
        """The call ends with `response` (an error): its one response, or its iterator's
        last."""
        if responses is None:
            future.set_result(response)
            return
        responses.put(response)
        responses.put(None)
        self._hand_over(call_id, future, responses)

    def _hand_over(self, call_id: int, future: _Future, responses: _Responses) -> None:
        """A decoupled call's iterator, to the model once its first answer has come."""
        if not future.done():
            iterator = pb_utils.ResponseIterator(
                iter(responses.get, None), lambda: self._withdraw(call_id)
            )
            future.set_result(iterator)

    def _withdraw(self, call_id: int) -> None:
        """ResponseIterator.cancel(): the server cancels the call, if it has not ended."""
        with self._calls_lock:
            if call_id not in self._calls or self._closed:
                return
        self.send(protocol.BlsCancel(call_id))


def _response(data: bytes, refs: tuple[protocol.TensorRef, ...]) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse([pb_utils.Tensor(r.name, input_array(data, r)) for r in refs])


def _wire_array(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """str elements as UTF-8 bytes (BYTES tensors travel as bytes)."""
    if array.dtype.kind not in "SU":
        return array
    values = [v.encode() if isinstance(v, str) else bytes(v) for v in array.flat]
    encoded = np.empty(len(values), dtype=object)
    encoded[:] = values
    return encoded.reshape(array.shape)


def _error(message: str, code: int = pb_utils.TritonError.INTERNAL) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
