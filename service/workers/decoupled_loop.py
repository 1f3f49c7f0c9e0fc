"""A decoupled Python model's worker, after the load: the socket is never blocked by the
model. This thread reads (Submit, Cancel, Credit, Shutdown: Cancel and Credit act at once,
even while execute() runs or a sender waits for credit), one thread runs execute() for each
Submit in order, and one writes every Response, in the order the model sent them.

Threads start only now: the Python sandbox was entered by the single-threaded process, before
model.py was imported."""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

from service.backend.decoupled import DecoupledRequests
from service.backend.python_model import PythonModel
from service.backend.python_runtime import triton_python_backend_utils as pb_utils
from service.backend.response_flow import Reply
from service.workers import protocol
from service.workers.tensor_io import inline_arrays, input_array

WRITE_BYTES = 256 << 10  # the writer joins queued messages into one write while under this


def serve_decoupled(
    model: PythonModel,
    recv: Callable[[], protocol.Message | None],
    sock: socket.socket,
    max_message: int,
) -> NoReturn:
    """Never returns: after Shutdown (finalize() first) or the server's end of the socket
    closing, the process exits, whatever threads model.py still runs; requests still open
    get nothing more."""
    requests = DecoupledRequests(
        model, protocol.RESPONSE_WINDOW, lambda reply: encoded(reply, max_message)
    )
    pb_utils.set_metric_sink(
        lambda op: requests.outbox.post(protocol.encode(protocol.MetricUpdate(*op)))
    )
    submits: queue.SimpleQueue[protocol.Submit | None] = queue.SimpleQueue()
    runner = _thread("execute", lambda: _run(requests, submits))
    writer = _thread("write", lambda: _write(requests, sock))
    runner.start()
    writer.start()
    while True:
        msg = recv()
        if isinstance(msg, protocol.Submit):
            requests.admit(msg.request_id, msg.id, msg.outputs)
            submits.put(msg)
        elif isinstance(msg, protocol.Credit):
            requests.credit(msg.request_id, msg.count)
        elif isinstance(msg, protocol.Cancel):
            requests.cancel(msg.request_id)
        elif msg is None or isinstance(msg, protocol.Shutdown):
            break
    requests.stop()
    if msg is not None:
        submits.put(None)
        runner.join()
        model.finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _thread(name: str, target: Callable[[], None]) -> threading.Thread:
    """A thread whose failure (a bug here, not the model's: its errors fail its requests)
    ends the worker, which the server sees and replaces, rather than leaving it deaf."""

    def run() -> None:
        try:
            target()
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    return threading.Thread(target=run, name=name, daemon=True)


def _run(requests: DecoupledRequests, submits: queue.SimpleQueue[protocol.Submit | None]) -> None:
    while (msg := submits.get()) is not None:
        try:
            inputs = {ref.name: input_array(msg.data, ref) for ref in msg.inputs}
        except (ValueError, TypeError) as exc:
            requests.fail(msg.request_id, f"its inputs cannot be read ({exc})")
            continue
        requests.execute(msg.request_id, inputs, msg.outputs, msg.id, msg.parameters)
        del inputs, msg  # the model's arrays (views of the Submit's bytes) go with them


def _write(requests: DecoupledRequests, sock: socket.socket) -> None:
    while (messages := requests.outbox.next(WRITE_BYTES)) is not None:
        sock.sendall(messages)


def encoded(reply: Reply, max_message: int) -> bytes:
    """The reply as a Response, its outputs encoded as the worker encodes any output
    (tensor_io.wire_form), inline; outputs of more than `max_message` bytes (what the caller
    may receive, and all the front-end reads of one response) become the request's error."""
    refs, data = inline_arrays(reply.outputs.items())
    response = protocol.Response(
        reply.request_id, refs, data, reply.final, reply.error, reply.error_code
    )
    if len(data) > max_message:
        error = (
            f"the model's response holds {len(data)} bytes of outputs, more than the "
            f"{max_message} a caller may receive (--max-message-bytes)"
        )
        response = protocol.Response(reply.request_id, (), b"", reply.final, error)
    return protocol.encode(response)
