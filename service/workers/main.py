"""Entry point of a worker process: `python -m service.workers.main --fd N --segments-fd M`
(N: the socket for messages, M: the one shared-memory segments arrive on).

The front-end sets the environment (device visibility, thread counts) before this process
starts, so it is in force before paddle is imported.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
import traceback
from typing import TYPE_CHECKING, Any

import numpy as np

from service.backend.load import Load
from service.backend.sandbox.privileges import undumpable
from service.model.files import PYTHON_BACKEND
from service.model.parameters import (
    PYTHON_CHILD_PROCESSES,
    TESTING_CRASH_ON,
    TESTING_SCRIBBLE_ON,
    child_processes,
)
from service.placement.cpulist import CPU_AFFINITY_ENV, parse_cpulist
from service.workers import protocol
from service.workers.shm import MappingCache, layout
from service.workers.tensor_io import input_array, wire_form

if TYPE_CHECKING:
    from service.workers.bls_link import BlsLink


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        chunk = sock.recv(remaining)
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> protocol.Message | None:
    header = _recv_exact(sock, protocol.header_size())
    if header is None:
        return None
    body = _recv_exact(sock, protocol.body_size(header))
    return None if body is None else protocol.decode(body)


def _infer(
    model: Any, maps: MappingCache, msg: protocol.Infer, crash_on: float | None
) -> protocol.Result | protocol.Failed:
    maps.retire(msg.retired)
    in_map = maps.get(msg.input_segment)
    inputs = {ref.name: input_array(in_map, ref) for ref in msg.inputs}
    if crash_on is not None and any((a == crash_on).any() for a in inputs.values()):
        os.abort()  # test-only (--testing-service): stands in for a crash inside Paddle
    arrays, timings = model.run(inputs, msg.outputs)
    encoded = {name: wire_form(a) for name, a in arrays.items()}
    offsets, total = layout(data.nbytes for _, data in encoded.values())
    if total > msg.output_capacity:
        if total > msg.inline_capacity:
            # The front-end would kill a worker that sent them (message_bounds.py).
            return protocol.Failed(
                msg.request_id,
                f"the outputs take {total} bytes, more than the {msg.inline_capacity} this "
                "batch's callers may receive (--max-message-bytes each)",
                too_large=True,
            )
        inline = {name: data.tobytes() for name, (_, data) in encoded.items()}
        refs = tuple(
            protocol.TensorRef(n, dtype, arrays[n].shape, 0, data.nbytes)
            for n, (dtype, data) in encoded.items()
        )
        return protocol.Result(msg.request_id, timings, refs, inline)
    out_map = maps.get(msg.output_segment)
    refs_list = []
    for (name, (dtype, data)), offset in zip(encoded.items(), offsets, strict=True):
        np.ndarray((data.nbytes,), np.uint8, buffer=out_map, offset=offset)[...] = data
        refs_list.append(protocol.TensorRef(name, dtype, arrays[name].shape, offset, data.nbytes))
    return protocol.Result(msg.request_id, timings, tuple(refs_list))


def serve(sock: socket.socket, segments: socket.socket) -> int:
    load = _recv(sock)
    if not isinstance(load, Load):
        return 2
    try:
        model = build(load)
    except Exception as exc:
        sock.sendall(protocol.encode(protocol.LoadFailed(failure_reason(exc, load))))
        return 1
    unprotected = getattr(model, "unprotected", None)
    completed = getattr(model, "completed_config", b"")
    loaded = protocol.Loaded(model.inputs, model.outputs, model.device, unprotected, completed)
    sock.sendall(protocol.encode(loaded))
    if getattr(model, "decoupled", False):  # its own loop, which ends the process
        from service.workers.decoupled_loop import serve_decoupled

        serve_decoupled(model, _recv, sock, segments, load.max_message_bytes)
    maps = MappingCache(segments)
    # The front-end passes this parameter on only when it runs with --testing-service.
    crash_text = load.parameters.get(TESTING_CRASH_ON)
    crash_on = None if crash_text is None else float(crash_text)
    link = _bls_link(sock, load.max_message_bytes) if load.backend == PYTHON_BACKEND else None
    recv = link.recv if link is not None else lambda: _recv(sock)
    while True:
        msg = recv()
        if msg is None or isinstance(msg, protocol.Shutdown):
            if isinstance(msg, protocol.Shutdown) and hasattr(model, "finalize"):
                model.finalize()
            return 0
        if isinstance(msg, protocol.Queues):
            from service.workers.queued_loop import SocketInbox, serve_queued

            scribble = load.parameters.get(TESTING_SCRIBBLE_ON)
            testing = (crash_on, None if scribble is None else float(scribble))
            inbox = SocketInbox(sock, recv) if link is None else link.queued(load.model_name)
            return serve_queued(
                model, msg, inbox, segments, lambda e: _reason(e, load.backend), testing
            )
        if not isinstance(msg, protocol.Infer):
            continue
        if link is not None:
            link.caller = msg.request_id
        reply: protocol.Message
        try:
            reply = _infer(model, maps, msg, crash_on)
        except Exception as exc:
            reply = protocol.Failed(msg.request_id, _reason(exc, load.backend))
        if link is not None:
            link.send(reply)
        else:
            sock.sendall(protocol.encode(reply))


def _bls_link(sock: socket.socket, max_message: int) -> BlsLink:
    """A Python model's socket, read by a thread of its own so that the model can make BLS
    calls (bls_link.py); Paddle workers read theirs in the main loop."""
    from service.backend.python_runtime import triton_python_backend_utils as pb_utils
    from service.workers.bls_link import BlsLink

    link = BlsLink(sock, lambda: _recv(sock), max_message)
    pb_utils.set_model_caller(link)
    pb_utils.set_metric_sink(lambda op: link.send(protocol.MetricUpdate(*op)))
    return link


# The model the model template this process was forked from built (template.py), and the Load
# it was built from.
_inherited: tuple[Load, Any] | None = None


def inherit(load: Load, model: Any) -> None:
    """In a model template: the model its workers take instead of building one (build)."""
    global _inherited
    _inherited = (load, model)


def build(load: Load) -> Any:
    """The model the model template built, where it was built from an equal Load (the same
    version, parameters and config); else a new one."""
    if _inherited is not None and _inherited[0] == load:
        return _inherited[1]
    if load.backend == PYTHON_BACKEND:
        from service.backend.python_model import PythonModel

        return PythonModel(load)
    from service.backend.paddle_model import PaddleModel

    return PaddleModel(load)


def failure_reason(exc: BaseException, load: Load) -> str:
    """Why loading failed, as the server reports it."""
    return _reason(exc, load.backend) + _process_hint(load, exc)


def _reason(exc: BaseException, backend: str) -> str:
    """A Python model's message whole, as Triton passes it on; Paddle's exceptions carry a C++
    stack, whose useful line names the error class."""
    if backend == PYTHON_BACKEND:
        from service.backend.python_model import failure_text

        return failure_text(exc)
    text = str(exc).strip()
    for line in text.splitlines():
        if "Error:" in line or "Error]" in line:
            return line.strip()[:2000]
    lines = text.splitlines() or traceback.format_exception_only(exc)
    return f"{type(exc).__name__}: {lines[0].strip()}"[:2000]


def _process_hint(load: Load, exc: BaseException) -> str:
    """What to set when a sandboxed Python model was refused a new process (EPERM from
    seccomp): importing paddle, or any subprocess, needs python_child_processes."""
    if load.backend != PYTHON_BACKEND or child_processes(load.parameters):
        return ""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno == errno.EPERM:
            break
        cause = cause.__cause__ or cause.__context__
    if cause is None and "Operation not permitted" not in str(exc):
        return ""
    return (
        " (a sandboxed Python model starts no process unless its config sets the parameter "
        f"{PYTHON_CHILD_PROCESSES}: importing paddle needs 4)"
    )


def _pin_cpus() -> None:
    """Run on the CPUs placement chose (near the device), as far as this process may."""
    wanted = os.environ.get(CPU_AFFINITY_ENV)
    if wanted:
        usable = parse_cpulist(wanted) & os.sched_getaffinity(0)
        if usable:
            os.sched_setaffinity(0, usable)


def main(argv: list[str] | None = None) -> int:
    """`argv`: the options, when the preloaded launcher runs this in a forked process."""
    # The environment is the server's (a Paddle worker's) or holds placement's settings: no
    # other process of this user reads it, or this process's memory, through /proc.
    undumpable()
    _pin_cpus()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--segments-fd", type=int, required=True)
    args = parser.parse_args(argv)
    # What the model's code logs (and this project's code in the worker, e.g. the generation
    # engine) goes to stderr, which the server forwards into its log under the model's name.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # The front-end owns shutdown; Ctrl-C in the terminal must not kill workers first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    segments = socket.socket(fileno=args.segments_fd)
    try:
        return serve(sock, segments)
    finally:
        sock.close()
        segments.close()
        sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("GLOG_minloglevel", "2")
    sys.exit(main())
