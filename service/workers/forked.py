"""The server's side of the preloaded launcher (preloaded.py): starting it, asking it for a
worker's launcher or a model template (templates.py), whose processes end, are waited for and
are signalled like the process of a launcher the server started itself (fork_channel.py).

The launcher is started with the first Paddle worker and again after it dies: the processes it
forked end with it (their workers too, which the instances see as deaths and restart, their
requests queued again), and a spawn it did not answer falls back to a fresh start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from service.workers import subreaper
from service.workers.fork_channel import ForkChannel, ForkedProcess

log = logging.getLogger("paddlequic.worker")


class PreloadedLauncher:
    def __init__(self) -> None:
        self._process: asyncio.subprocess.Process | None = None
        self._channel: ForkChannel | None = None
        self._starting = asyncio.Lock()
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
        request = {"argv": list(argv), "env": dict(env), "title": title}
        return await self.fork(request, sockets)

    async def fork(
        self, request: Mapping[str, Any], sockets: Sequence[socket.socket]
    ) -> ForkedProcess | None:
        """What it forked for `request` (a worker's launcher, or with "template" a model
        template, preloaded.py), or None (it refused, or it is gone)."""
        data = json.dumps(request).encode()
        for _ in range(2):  # a launcher that died meanwhile is started again, once
            channel = await self._started()
            if channel is None:
                return None
            reply = await channel.request(data, [s.fileno() for s in sockets])
            if reply is None:
                continue
            if "pid" not in reply:
                self._warn(str(reply.get("refused", reply)))
                return None
            return channel.forked[int(reply["pid"])]
        self._warn("it ended twice while starting this worker")
        return None

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("starting a Paddle worker without the preloaded launcher: %s", why)

    async def _started(self) -> ForkChannel | None:
        async with self._starting:
            if self._channel is None or self._channel.sock is None:
                try:
                    await self._start()
                except OSError as exc:
                    self._warn(f"it cannot start ({exc.strerror or exc})")
            return self._channel

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
                # Out of the server's process group, and so is every launcher it forks: a
                # signal to the group (Ctrl-C's SIGINT, `timeout`'s or a supervisor's SIGTERM)
                # reaches the server, which drains its calls on the workers and then ends
                # them; it must not end them first. They die with the server all the same
                # (PR_SET_PDEATHSIG). A group, not a session: a session of their own is a
                # scheduling group of its own where the kernel has autogroups, which gave the
                # workers a share of the CPU apart from the server's (and failed a test).
                process_group=0,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        # Ended by PR_SET_PDEATHSIG, whatever their workers were computing.
        ended = subreaper.ENDED_WITH_PRELOADED << 8  # a wait status
        self._channel = channel = ForkChannel(ours, ended)
        channel.on_end = lambda: self._ended(channel)

    def _ended(self, channel: ForkChannel) -> None:
        """Called after each end of a process it forked too: only its own end counts. Its
        launchers end with it, which their instances see as deaths; the next spawn starts it
        again."""
        if channel.sock is not None:
            return
        if self._process is not None and self._process.returncode is None:
            self._process.send_signal(signal.SIGKILL)
        if not self._stopping:
            log.error("the preloaded launcher of Paddle workers ended; the next worker starts it")

    async def stop(self) -> None:
        self._stopping = True
        if self._channel is not None:
            self._channel.close()
        if self._process is not None:
            await self._process.wait()
