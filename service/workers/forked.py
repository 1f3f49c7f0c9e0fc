"""The server's side of the preloaded launcher (preloaded.py): starting it, asking it for a
worker's launcher, and the handle on a launcher it forked, which ends, is waited for and is
signalled like the process of a launcher the server started itself.

The launcher is started with the first Paddle worker and again after it dies: the launchers it
forked end with it (their workers too, which the instances see as deaths and restart, their
requests queued again), and a spawn it did not answer falls back to a fresh start.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from service.workers import subreaper

log = logging.getLogger("paddlequic.worker")

MAX_REPLY_BYTES = 4096


class ForkedProcess:
    """A launcher the preloaded launcher forked: what the instance needs of an
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


class PreloadedLauncher:
    def __init__(self) -> None:
        self._process: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._replies: collections.deque[asyncio.Future[dict[str, Any] | None]] = (
            collections.deque()
        )
        self._forked: dict[int, ForkedProcess] = {}
        self._starting = asyncio.Lock()
        self._sending = asyncio.Lock()
        self._warned = False
        self._stopping = False

    async def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        sockets: Sequence[socket.socket],
        title: str,
    ) -> ForkedProcess | None:
        """A launcher running the worker on `sockets` (messages, segments), or None: start
        the worker as without this launcher (it refused, or it is gone). `title`: what ps
        shows of both (the instance's name)."""
        request = json.dumps({"argv": list(argv), "env": dict(env), "title": title}).encode()
        for _ in range(2):  # a launcher that died meanwhile is started again, once
            sock = await self._started()
            if sock is None:
                return None
            loop = asyncio.get_running_loop()
            future: asyncio.Future[dict[str, Any] | None] = loop.create_future()
            try:
                await self._send(sock, request, [s.fileno() for s in sockets])
            except OSError:
                if self._sock is sock:
                    self._ended()
                continue
            self._replies.append(future)
            # Cancelled (its caller gave up), the future's answer still comes, in order: a
            # launcher forked for it is ended then (_readable).
            reply = await future
            if reply is None:
                continue
            if "pid" not in reply:
                self._warn(str(reply.get("refused", reply)))
                return None
            forked = ForkedProcess(int(reply["pid"]))
            self._forked[forked.pid] = forked
            return forked
        self._warn("it ended twice while starting this worker")
        return None

    async def _send(self, sock: socket.socket, request: bytes, fds: list[int]) -> None:
        """One request, waiting while the socket's buffer is full (the launcher may still be
        importing Paddle while a repository's workers are asked for at once)."""
        loop = asyncio.get_running_loop()
        async with self._sending:  # one writer callback per descriptor: one sender at a time
            while True:
                try:
                    socket.send_fds(sock, [request], fds)
                    return
                except BlockingIOError:
                    writable = loop.create_future()
                    loop.add_writer(sock.fileno(), writable.set_result, None)
                    try:
                        await writable
                    finally:
                        loop.remove_writer(sock.fileno())

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("starting a Paddle worker without the preloaded launcher: %s", why)

    async def _started(self) -> socket.socket | None:
        async with self._starting:
            if self._sock is None:
                try:
                    await self._start()
                except OSError as exc:
                    self._warn(f"it cannot start ({exc.strerror or exc})")
            return self._sock

    async def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # numpy's OpenBLAS would start threads at import, and a process with a second
            # thread is never forked.
            env = {**os.environ, "GLOG_minloglevel": "2", "OPENBLAS_NUM_THREADS": "1"}
            self._process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "service.workers.preloaded",
                "--fd",
                str(theirs.fileno()),
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        asyncio.get_running_loop().add_reader(ours.fileno(), self._readable)

    def _readable(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(MAX_REPLY_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._ended()
            return
        message = json.loads(data)
        if "exited" in message:
            forked = self._forked.pop(int(message["exited"]), None)
            if forked is not None:
                forked.ended(int(message["status"]))
        elif self._replies:
            future = self._replies.popleft()
            if future.cancelled():
                _end_unwanted(message)
            else:
                future.set_result(message)

    def _ended(self) -> None:
        """It died (or the server stops it): the launchers it forked end with it (their
        PR_SET_PDEATHSIG), which their instances see as deaths; the next spawn starts it
        again."""
        assert self._sock is not None
        asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None
        if self._process is not None and self._process.returncode is None:
            self._process.send_signal(signal.SIGKILL)
        while self._replies:
            future = self._replies.popleft()
            if not future.done():
                future.set_result(None)
        forked, self._forked = self._forked, {}
        for process in forked.values():
            # Ended by PR_SET_PDEATHSIG, whatever their workers were computing: no request of
            # theirs is to blame (none counts towards poison), and none is lost.
            process.ended(subreaper.ENDED_WITH_PRELOADED << 8)  # a wait status
        if not self._stopping:
            log.error("the preloaded launcher of Paddle workers ended; the next worker starts it")

    async def stop(self) -> None:
        self._stopping = True
        if self._sock is not None:
            self._ended()
        if self._process is not None:
            await self._process.wait()


def _end_unwanted(reply: dict[str, Any]) -> None:
    """A launcher forked for a worker start that was given up (its caller cancelled)."""
    if "pid" in reply:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(reply["pid"]), signal.SIGTERM)
