"""The server's side of model templates (template.py): a Paddle CPU model version with more than
one instance (WorkerSpec.template) has its instances' launchers forked from one process that
built its predictor, so that their workers share its weights.

The template is started through the preloaded launcher at the first spawn that finds none for
its Load, and ends when the last launcher it forked ended with no spawn under way (the server
closes its socket); a later spawn starts a new one. When it dies, the launchers it forked end
with it (their PR_SET_PDEATHSIG): they are reported ENDED_WITH_TEMPLATE, which blames no
request. Whatever goes wrong (its Load is larger than MAX_REQUEST_BYTES, it refused, failed to
build the model, died, took longer than BUILD_TIMEOUT_S), the spawn answers None and the
worker starts as without a template, which reports a model that cannot be built as it always
did.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
from collections.abc import Mapping, Sequence

from service.backend.load import Load
from service.workers import protocol, subreaper
from service.workers.fork_channel import MAX_REQUEST_BYTES, ForkChannel, ForkedProcess
from service.workers.forked import PreloadedLauncher

log = logging.getLogger("paddlequic.worker")

BUILD_TIMEOUT_S = 600.0  # one template's predictor, as a worker's load (launch.LOAD_TIMEOUT_S)


class _Template:
    def __init__(self, key: bytes, model: str, process: ForkedProcess) -> None:
        self.key = key
        self.model = model
        self.process = process
        self.channel: ForkChannel | None = None
        self.spawning = 0  # requests under way: it is not ended meanwhile
        self.bytes = 0  # its private memory once built: the model its workers share
        self.closed = False  # ended by the server


class ModelTemplates:
    def __init__(self, launcher: PreloadedLauncher) -> None:
        self._launcher = launcher
        self._templates: dict[bytes, asyncio.Future[_Template | None]] = {}
        self._warned = False

    async def spawn(
        self,
        load: Load,
        argv: Sequence[str],
        env: Mapping[str, str],
        sockets: Sequence[socket.socket],
        title: str,
    ) -> ForkedProcess | None:
        """A launcher running the worker on `sockets`, forked from the template of `load`,
        or None: start it without one."""
        key = protocol.encode(load)
        if len(key) > MAX_REQUEST_BYTES:
            self._warn(load, f"its Load takes {len(key)} bytes, more than {MAX_REQUEST_BYTES}")
            return None
        starting = self._templates.get(key)
        if starting is None or (starting.done() and _built(starting) is None):
            starting = asyncio.ensure_future(self._start(key, load, env))
            self._templates[key] = starting
        try:
            template = await asyncio.shield(starting)
        except asyncio.CancelledError:  # a template started for nothing is ended
            starting.add_done_callback(self._end_started_if_unused)
            raise
        if template is None or template.channel is None:
            return None
        request = {"argv": list(argv), "env": dict(env), "title": title}
        template.spawning += 1
        try:
            reply = await template.channel.request(json.dumps(request).encode(), _fds(sockets))
        finally:
            template.spawning -= 1
            self._end_if_unused(template)
        if reply is None:
            return None
        if "pid" not in reply:
            self._warn(load, str(reply.get("refused", reply)))
            return None
        return template.channel.forked.get(int(reply["pid"]))

    async def _start(self, key: bytes, load: Load, env: Mapping[str, str]) -> _Template | None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = await self._launcher.fork(
                {"template": load.model_name, "env": dict(env)}, [theirs]
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        if process is None:
            ours.close()
            del self._templates[key]
            return None
        template = _Template(key, load.model_name, process)
        ended = subreaper.ENDED_WITH_TEMPLATE << 8  # a wait status
        template.channel = ForkChannel(ours, ended, lambda: self._end_if_unused(template))
        template.spawning += 1  # until it answers
        reply = None
        try:
            async with asyncio.timeout(BUILD_TIMEOUT_S):
                reply = await template.channel.request(protocol.encode(load))
        except TimeoutError:
            reply = {"failed": f"building the model took longer than {BUILD_TIMEOUT_S:.0f} s"}
        finally:
            template.spawning -= 1
        if reply is None or "ready" not in reply:
            why = "it ended" if reply is None else str(reply.get("failed", reply))
            self._warn(load, why)
            del self._templates[key]
            self._close(template)
            return None
        template.bytes = int(reply.get("bytes", 0))
        return template

    def held_bytes(self, load: Load) -> int:
        """What the template of `load` holds of its own (the model its instances' workers
        share, given back when it ends; none of their private memory counts it); 0: none."""
        starting = self._templates.get(protocol.encode(load))
        template = None if starting is None else _built(starting)
        return 0 if template is None or template.closed else template.bytes

    def _end_started_if_unused(self, starting: asyncio.Future[_Template | None]) -> None:
        if (template := _built(starting)) is not None:
            self._end_if_unused(template)

    def _end_if_unused(self, template: _Template) -> None:
        """After each end of a launcher it forked, and of a spawn: with none left, it ends."""
        channel = template.channel
        if channel is None:
            return
        if channel.sock is None:
            if not template.closed:
                log.error(
                    "the model template of model '%s' ended; its instances start again",
                    template.model,
                )
            self._forget(template)
        elif not channel.forked and template.spawning == 0:
            self._close(template)

    def _close(self, template: _Template) -> None:
        """Its socket closed, it exits; killed too, should it still be building."""
        template.closed = True
        self._forget(template)
        if template.channel is not None:
            template.channel.close()
        template.process.send_signal(signal.SIGKILL)

    def _forget(self, template: _Template) -> None:
        starting = self._templates.get(template.key)
        if starting is not None and _built(starting) is template:
            del self._templates[template.key]

    def _warn(self, load: Load, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "starting model '%s''s workers without a model template: %s", load.model_name, why
            )

    def stop(self) -> None:
        """Before the preloaded launcher, with which one still building ends."""
        for starting in list(self._templates.values()):
            if not starting.done():
                starting.cancel()
            elif (template := _built(starting)) is not None:
                self._close(template)


def _built(starting: asyncio.Future[_Template | None]) -> _Template | None:
    """The template a start gave, once done; None while under way, or where it gave none."""
    if not starting.done() or starting.cancelled() or starting.exception() is not None:
        return None
    return starting.result()


def _fds(sockets: Sequence[socket.socket]) -> list[int]:
    return [s.fileno() for s in sockets]
