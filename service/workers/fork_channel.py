"""The server's socket to a process that forks workers' launchers on request: the preloaded
launcher (preloaded.py) or a model template (template.py). Requests are answered in order;
`{"exited": pid, "status": wait status}` reports the end of a launcher it forked, which the
server holds as a ForkedProcess, like the process of a launcher it started itself."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import socket
from collections.abc import Callable, Sequence
from typing import Any

MAX_REPLY_BYTES = 4096
# What one request to a model template may carry (its Load): under the sockets' default buffer
# (net.core.wmem_default, 208 KiB), past which the kernel refuses a datagram (EMSGSIZE).
MAX_REQUEST_BYTES = 128 << 10


class ForkedProcess:
    """A launcher a forking process forked: what the instance needs of an
    asyncio.subprocess.Process (pid, returncode, wait, send_signal)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def ended(self, status: int) -> None:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(status)
            self._ended.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)

    def send_signal(self, signum: int) -> None:
        """Only while it has not been reaped, so its pid cannot be another process's."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


class ForkChannel:
    def __init__(
        self, sock: socket.socket, ended_status: int, on_end: Callable[[], None] = lambda: None
    ) -> None:
        """`ended_status`: the wait status given to what it forked when it ends (they end
        with it); `on_end`: called then, and after each launcher it forked ended."""
        sock.setblocking(False)
        self.sock: socket.socket | None = sock
        self._ended_status = ended_status
        self.on_end = on_end
        self._replies: collections.deque[asyncio.Future[dict[str, Any] | None]] = (
            collections.deque()
        )
        self.forked: dict[int, ForkedProcess] = {}
        self._sending = asyncio.Lock()
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)

    async def request(self, data: bytes, fds: Sequence[int] = ()) -> dict[str, Any] | None:
        """Its reply, or None: it ended first. A reply `{"pid"}` is held as a ForkedProcess
        (`forked`); cancelled (its caller gave up), the answer still comes, in order, and a
        launcher forked for it is ended then (_readable)."""
        sock = self.sock
        if sock is None:
            return None
        future: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        try:
            await self._send(sock, data, list(fds))
        except OSError:
            if self.sock is sock:
                self.close()
            return None
        self._replies.append(future)
        return await future

    async def _send(self, sock: socket.socket, data: bytes, fds: list[int]) -> None:
        """One request, waiting while the socket's buffer is full (the preloaded launcher may
        still be importing Paddle while a repository's workers are asked for at once)."""
        loop = asyncio.get_running_loop()
        async with self._sending:  # one writer callback per descriptor: one sender at a time
            while True:
                try:
                    socket.send_fds(sock, [data], fds)
                    return
                except BlockingIOError:
                    writable = loop.create_future()
                    loop.add_writer(sock.fileno(), writable.set_result, None)
                    try:
                        await writable
                    finally:
                        loop.remove_writer(sock.fileno())

    def _readable(self) -> None:
        assert self.sock is not None
        try:
            data = self.sock.recv(MAX_REPLY_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        message = json.loads(data)
        if "exited" in message:
            forked = self.forked.pop(int(message["exited"]), None)
            if forked is not None:
                forked.ended(int(message["status"]))
                self.on_end()
        elif self._replies:
            future = self._replies.popleft()
            if future.cancelled():
                _end_unwanted(message)
            elif "pid" in message:
                forked = ForkedProcess(int(message["pid"]))
                self.forked[forked.pid] = forked
                future.set_result(message)
            else:
                future.set_result(message)

    def close(self) -> None:
        """It ended (or the server ends it): what it forked ends with it, and no request of
        theirs is to blame (none counts towards poison), none is lost."""
        if self.sock is None:
            return
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.sock.close()
        self.sock = None
        while self._replies:
            future = self._replies.popleft()
            if not future.done():
                future.set_result(None)
        forked, self.forked = self.forked, {}
        for process in forked.values():
            process.ended(self._ended_status)
        self.on_end()


def _end_unwanted(reply: dict[str, Any]) -> None:
    """A launcher forked for a worker start that was given up (its caller cancelled)."""
    if "pid" in reply:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(reply["pid"]), signal.SIGTERM)
