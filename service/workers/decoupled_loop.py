"""A decoupled Python model's worker, after the load: no socket is ever blocked by the model.
A thread per process holding calls reads its socket (Submit, Cancel, Credit: Cancel and Credit
act at once, even while execute() runs or a sender waits for credit), one thread runs
execute() for each Submit in arrival order, and a thread per process writes its Responses, in
the order the model sent them.

The server's socket is the first; each front-end (--frontends N) gets one of its own
(AddProducer, its end on the segments channel), so its requests' responses go straight to it
and never through the server. A request is keyed by its process's number above its own id.
What the server sends on its socket stays there (Shutdown, AddProducer, DropProducer), as do
the model's metric updates.

Threads start only now: the Python sandbox was entered by the single-threaded process, before
model.py was imported."""

from __future__ import annotations

import contextlib
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
from service.backend.response_flow import Outbox, Reply
from service.workers import protocol
from service.workers.tensor_io import inline_arrays, input_array

WRITE_BYTES = 256 << 10  # the writer joins queued messages into one write while under this
PRODUCER_SHIFT = 40  # a request's key: its process's number above this many bits of its id
_OWN_ID = (1 << PRODUCER_SHIFT) - 1

Recv = Callable[[socket.socket], protocol.Message | None]
_Submits = queue.SimpleQueue[tuple[int, protocol.Submit] | None]


class _Producer:
    """One process's socket: its requests read, its responses written, each by a thread."""

    def __init__(
        self,
        number: int,
        sock: socket.socket,
        requests: DecoupledRequests,
        max_message: int,
        served: Callable[[], None] | None = None,
    ) -> None:
        """`served`: told of its first data response (a front-end's: protocol.Served)."""
        self.number = number
        self.sock = sock
        self.requests = requests
        self.outbox = Outbox(self._encoded)
        self._max_message = max_message
        self._served = served
        self._base = number << PRODUCER_SHIFT

    def _encoded(self, reply: Reply) -> bytes:
        if self._served is not None and reply.outputs:
            self._served()
            self._served = None
        return encoded(reply, self._max_message)

    def serve(self, recv: Recv, submits: _Submits) -> protocol.Message | None:
        """Its requests, until a message of another kind (returned) or the socket's end."""
        while True:
            msg = recv(self.sock)
            if isinstance(msg, protocol.Submit):
                key = self._key(msg.request_id)
                self.requests.admit(key, msg.id, msg.outputs, self.outbox)
                submits.put((key, msg))
            elif isinstance(msg, protocol.Credit):
                self.requests.credit(self._key(msg.request_id), msg.count)
            elif isinstance(msg, protocol.Cancel):
                self.requests.cancel(self._key(msg.request_id))
            else:
                return msg

    def _key(self, request_id: int) -> int:
        """The request as this worker keys it: this process's number above its own id."""
        return self._base | (request_id & _OWN_ID)

    def write(self) -> None:
        while (messages := self.outbox.next(WRITE_BYTES)) is not None:
            self.sock.sendall(messages)

    def start(self, recv: Recv, submits: _Submits) -> None:
        """A front-end's threads; its end (the socket closed, or DropProducer) cancels its
        requests and ends its writer."""

        def read() -> None:
            with contextlib.suppress(OSError):
                self.serve(recv, submits)
            self.end()

        _thread(f"read-{self.number}", read).start()
        _thread(f"write-{self.number}", self._write_until_gone).start()

    def _write_until_gone(self) -> None:
        """Writes until the front-end is gone, then closes the socket (its reader, which
        ended it or was ended through its shutdown, reads no more)."""
        try:
            self.write()
        except OSError:  # the front-end is gone
            self.end()
        self.sock.close()

    def end(self) -> None:
        self.requests.cancel_where(lambda key: key >> PRODUCER_SHIFT == self.number)
        self.outbox.close()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


def serve_decoupled(
    model: PythonModel,
    recv: Recv,
    sock: socket.socket,
    segments: socket.socket,
    max_message: int,
) -> NoReturn:
    """Never returns: after Shutdown (finalize() first) or the server's end of the socket
    closing, the process exits, whatever threads model.py still runs; requests still open
    get nothing more."""
    requests = DecoupledRequests(model, protocol.RESPONSE_WINDOW)
    server = _Producer(0, sock, requests, max_message)
    pb_utils.set_metric_sink(
        lambda op: server.outbox.post(protocol.encode(protocol.MetricUpdate(*op)))
    )
    producers: dict[int, _Producer] = {}
    submits: _Submits = queue.SimpleQueue()

    def served() -> None:
        """The server hears of a front-end's first response (its answers never cross the
        server's socket)."""
        server.outbox.post(protocol.encode(protocol.Served()))

    runner = _thread("execute", lambda: _run(requests, submits))
    writer = _thread("write", server.write)
    runner.start()
    writer.start()
    while True:
        msg = server.serve(recv, submits)
        if isinstance(msg, protocol.AddProducer) and msg.producer > 0:
            _, fds, _, _ = socket.recv_fds(segments, 256, 1)
            old = producers.pop(msg.producer, None)
            if old is not None:
                old.end()
            if len(fds) == 1:
                sock_in = socket.socket(fileno=fds[0])
                producer = _Producer(msg.producer, sock_in, requests, max_message, served)
                producers[msg.producer] = producer
                producer.start(recv, submits)
            else:
                for fd in fds:
                    os.close(fd)
        elif isinstance(msg, protocol.DropProducer):
            gone = producers.pop(msg.producer, None)
            if gone is not None:
                gone.end()
        elif msg is None or isinstance(msg, protocol.Shutdown):
            break
    requests.stop()
    server.outbox.close()
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


def _run(requests: DecoupledRequests, submits: _Submits) -> None:
    while (submitted := submits.get()) is not None:
        key, msg = submitted
        try:
            inputs = {ref.name: input_array(msg.data, ref) for ref in msg.inputs}
        except (ValueError, TypeError) as exc:
            requests.fail(key, f"its inputs cannot be read ({exc})")
            continue
        requests.execute(key, inputs, msg.outputs, msg.id, msg.parameters)
        del inputs, msg, submitted  # the model's arrays (views of the Submit's bytes) go too


def encoded(reply: Reply, max_message: int) -> bytes:
    """The reply as a Response, its outputs encoded as the worker encodes any output
    (tensor_io.wire_form), inline; outputs of more than `max_message` bytes (what the caller
    may receive, and all the front-end reads of one response) become the request's error."""
    refs, data = inline_arrays(reply.outputs.items())
    request_id = reply.request_id & _OWN_ID  # as the process that sent it numbers it
    response = protocol.Response(request_id, refs, data, reply.final, reply.error, reply.error_code)
    if len(data) > max_message:
        error = (
            f"the model's response holds {len(data)} bytes of outputs, more than the "
            f"{max_message} a caller may receive (--max-message-bytes)"
        )
        response = protocol.Response(request_id, (), b"", reply.final, error)
    return protocol.encode(response)
