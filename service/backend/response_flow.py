"""The way out of a decoupled request's responses in a worker: a window of responses the
server has not yet taken (send() waits while it is full, so a caller that stops reading stops
its model's sender), cancellation, and the order of everything a worker sends.

Responses go into one Outbox in the order they were sent, encoded at once (as in Triton, send()
takes the data: the model may reuse its arrays when it returns); the worker's writer takes them
from there. A sender released by the model posts to the Outbox too (from __del__, where no lock
may be taken: SimpleQueue.put is reentrant), and the writer ends that request with an error."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.backend.python_runtime import triton_python_backend_utils as pb_utils


@dataclass(frozen=True)
class Reply:
    """One response of a decoupled request, before the worker encodes it."""

    request_id: int
    outputs: dict[str, np.ndarray[Any, Any]]
    final: bool
    error: str | None = None
    error_code: int = pb_utils.TritonError.INTERNAL


class Outbox:
    """Replies of all of a worker's decoupled requests, in sending order, as `encode` makes
    them into the worker's messages."""

    def __init__(self, encode: Callable[[Reply], bytes]) -> None:
        self._encode = encode
        self._queue: queue.SimpleQueue[bytes | ResponseFlow | None] = queue.SimpleQueue()
        self._closed = False  # next() took the close

    def put(self, reply: Reply) -> None:
        self._queue.put(self._encode(reply))

    def post(self, message: bytes) -> None:
        """A message of the worker's own (a metric update), in order with the replies."""
        self._queue.put(message)

    def abandoned(self, flow: ResponseFlow) -> None:
        self._queue.put(flow)

    def close(self) -> None:
        self._queue.put(None)

    def next(self, most: int) -> bytes | None:
        """The messages to write next, joined (None: closed): all that are queued once the
        first comes, while they are under `most` bytes, so that a step of many generations'
        tokens goes in one write, not one per token. Settles released senders on the way."""
        if self._closed:
            return None
        messages: list[bytes] = []
        size = 0
        while not messages or size < most:
            try:
                item = self._queue.get(block=not messages)
            except queue.Empty:
                break
            if item is None:
                self._closed = True
                break
            if isinstance(item, bytes):
                messages.append(item)
                size += len(item)
            else:
                item.settle_abandoned()
        return b"".join(messages) if messages else None


# Checks a response's outputs against the config: the arrays to send, or ValueError saying why.
Check = Callable[[pb_utils.InferenceResponse], dict[str, np.ndarray[Any, Any]]]


class ResponseFlow:
    """One decoupled request: pb_utils' ResponseChannel for its sender. At most `window` data
    replies are out and not credited (send() waits beyond); the final one, the model's or the
    worker's error, needs no credit (it ends the request, so the server's side holds at most
    the window and it), and `on_end` is told then."""

    def __init__(
        self,
        request_id: int,
        label: str,
        window: int,
        outbox: Outbox,
        check: Check,
        on_end: Callable[[int], None],
    ) -> None:
        self.request_id = request_id
        self._label = label  # "request 'ID' of model 'NAME'", for messages
        self._window = window
        self._outbox = outbox
        self._check = check
        self._on_end = on_end
        self._cond = threading.Condition()
        self._uncredited = 0
        self._cancelled = False
        self._stopped = False
        self._closed = False  # the final response was sent (or failed): send() refuses
        self._over = False  # the final reply went out or was dropped

    def send(self, response: pb_utils.InferenceResponse | None, final: bool) -> None:
        if self._closed:
            raise pb_utils.TritonModelException(pb_utils.SENDER_CLOSED)
        code = pb_utils.TritonError.INTERNAL
        if response is None:
            outputs: dict[str, np.ndarray[Any, Any]] = {}
            error = None
        elif (model_error := response.error()) is not None:
            outputs, error, code = {}, model_error.message(), model_error.code()
        else:
            try:
                outputs, error = self._check(response), None
            except (ValueError, TypeError) as exc:  # TypeError: a BYTES element of no bytes
                self.fail(f"{self._label}: {exc}")
                raise pb_utils.TritonModelException(str(exc)) from None
        with self._cond:
            if self._closed:
                raise pb_utils.TritonModelException(pb_utils.SENDER_CLOSED)
            self._closed = final
            while not final and self._uncredited >= self._window and not self._gone():
                self._cond.wait()
            if self._over:  # another thread's final went first
                raise pb_utils.TritonModelException(pb_utils.SENDER_CLOSED)
            if not self._gone():
                self._outbox.put(Reply(self.request_id, outputs, final, error, code))
                if not final:
                    self._uncredited += 1
            if final:
                self._end()

    def fail(self, message: str) -> None:
        """End the request with an error final reply (unless it ended already)."""
        with self._cond:
            if self._over:
                return
            self._closed = True
            if not self._gone():
                self._outbox.put(Reply(self.request_id, {}, True, message))
            self._end()

    def credit(self, count: int) -> None:
        with self._cond:
            self._uncredited = max(0, self._uncredited - count)
            self._cond.notify_all()

    def cancel(self) -> None:
        """The caller is gone: is_cancelled() turns true and nothing more is sent."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def stop(self) -> None:
        """The worker shuts down: blocked senders return, nothing more is sent."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def is_cancelled(self) -> bool:
        return self._cancelled or self._stopped

    def writable(self) -> bool:
        with self._cond:
            return self._closed or self._gone() or self._uncredited < self._window

    def abandon(self) -> None:
        self._outbox.abandoned(self)

    def settle_abandoned(self) -> None:
        self.fail(
            f"{self._label}: the model released its response sender without sending "
            "pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL"
        )

    def _gone(self) -> bool:
        return self._cancelled or self._stopped or self._over

    def _end(self) -> None:
        if not self._over:
            self._over = True
            self._cond.notify_all()
            self._on_end(self.request_id)
