"""The preloaded launcher: `python -m service.workers.preloaded --fd N` imports Paddle, numpy
and the worker's code once, then forks each Paddle worker's launcher (subreaper.py) from that
image on request, so a worker starts without importing Paddle again and shares its pages with
this process copy-on-write (a tiny model's worker holds about 12 MB of its own instead of 135).

It holds no secret and none of the server's sockets: it is started before any worker, with only
its own socket, and the server's environment (which Paddle workers get anyway). It never forks
while it has a second thread (a fork copies one thread, and a lock another held stays held in
the child): it checks before every fork and refuses, and the server then starts that worker as
it does without this launcher (launch.py).

Requests and replies are JSON datagrams on a SOCK_SEQPACKET socket: `{"argv", "env", "title"}`
(the title names the forked processes for ps: `paddlequic launcher|worker INSTANCE`) with the
worker's two sockets as descriptors, answered `{"pid"}` or `{"refused"}` in order; and
`{"exited": pid, "status": wait status}` when a launcher it forked ends (it reaps them). It ends
with the server (PR_SET_PDEATHSIG); the launchers it forked then end their workers.

A request `{"template", "env"}` with one socket forks a model template instead (template.py):
it builds one model version's predictor on that socket's Load and then serves requests for
its instances' launchers on it, as this process does, so that they share its weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import setproctitle

from service.backend.sandbox._libc import PR_SET_PDEATHSIG, prctl
from service.backend.sandbox.privileges import undumpable
from service.workers import subreaper, template

MAX_REQUEST_BYTES = 1 << 20  # a request's argv and environment (the server's own, bounded)


def preload() -> None:
    """What every Paddle worker imports (service/workers/main.py, backend/paddle_model.py)."""
    import numpy  # noqa: F401

    import service.backend.paddle_model  # Paddle itself
    import service.workers.main  # noqa: F401


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve(
    sock: socket.socket,
    wakeup: socket.socket,
    own: Sequence[socket.socket] = (),
    name: str = "the preloaded launcher",
) -> None:
    """Answer spawn requests until the server closes the socket. `wakeup` is readable when a
    child may have ended (SIGCHLD, through signal.set_wakeup_fd); `own`: sockets of this
    process a forked launcher closes; `name`: this process's, in a refusal."""
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wakeup, selectors.EVENT_READ)
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj is wakeup:
                    with contextlib.suppress(BlockingIOError):
                        wakeup.recv(4096)
                    continue
                data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST_BYTES, 2)
                if not data:
                    return
                try:
                    _spawn(sock, json.loads(data), fds, (wakeup, *own), name)
                finally:
                    for fd in fds:
                        os.close(fd)
            _report_exits(sock)
    finally:
        selector.close()


def _spawn(
    sock: socket.socket,
    request: dict[str, Any],
    fds: list[int],
    own: tuple[socket.socket, ...],
    name: str,
) -> None:
    wanted = 1 if "template" in request else 2
    if len(fds) != wanted:
        _send(sock, {"refused": f"this request carries {wanted} socket(s), not {len(fds)}"})
        return
    running = threads()
    if running != 1:
        _send(sock, {"refused": f"{name} runs {running} threads; forking it would copy "
                     "one of them with whatever locks the others hold"})  # fmt: skip
        return
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        if "template" in request:
            _become_template(sock, request, fds[0], own, parent)
        _become_launcher(sock, request, fds, own)
    _send(sock, {"pid": pid})


def _leave(sock: socket.socket, own: tuple[socket.socket, ...], env: dict[str, str]) -> None:
    """In a forked child: none of the parent's sockets or signal wiring, the request's
    environment."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock.close()
    for end in own:
        end.close()
    os.environ.clear()
    os.environ.update(env)


def _become_launcher(
    sock: socket.socket, request: dict[str, Any], fds: list[int], own: tuple[socket.socket, ...]
) -> NoReturn:
    """In the forked child: the worker's launcher (subreaper.py), whose worker runs in its own
    process without exec (subreaper._become_worker). Never returns into this loop."""
    code = 127
    try:
        title = str(request.get("title", ""))
        # First: it takes over the memory of argv and the environment as the process began.
        setproctitle.setproctitle(f"paddlequic launcher {title}")
        _leave(sock, own, request["env"])
        messages, segments = fds
        worker = [
            subreaper.IN_PROCESS,
            title,
            "--fd",
            str(messages),
            "--segments-fd",
            str(segments),
        ]
        code = subreaper.main([*request["argv"], "--", *worker])
    finally:
        os._exit(code)


def _become_template(
    sock: socket.socket,
    request: dict[str, Any],
    channel: int,
    own: tuple[socket.socket, ...],
    parent: int,
) -> NoReturn:
    """In the forked child: a model template (template.py), serving its instances' launchers
    on `channel` until the server closes it. Never returns into this loop."""
    code = 127
    try:
        setproctitle.setproctitle(f"paddlequic model-template {request['template']}")
        _leave(sock, own, request["env"])
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # it ends with this launcher
        server = socket.socket(fileno=channel)
        code = 1
        # Not when the launcher ended before the line above.
        if os.getppid() == parent and template.build(server):
            wakeup, wakeup_write = _wakeup()
            serve(server, wakeup, (wakeup_write,), "the model template")
            code = 0
    finally:
        os._exit(code)


def _wakeup() -> tuple[socket.socket, socket.socket]:
    """A socket readable when a child may have ended: SIGCHLD writes to its other end."""
    wakeup, wakeup_write = socket.socketpair()
    for end in (wakeup, wakeup_write):
        end.setblocking(False)
    signal.set_wakeup_fd(wakeup_write.fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through the fd
    return wakeup, wakeup_write


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "status": status})


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args()
    undumpable()
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the server ended before the line above
        return 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server owns shutdown
    preload()
    sock = socket.socket(fileno=args.fd)
    wakeup, wakeup_write = _wakeup()
    try:
        serve(sock, wakeup, (wakeup_write,))
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
