"""Keeps N front-end processes running: one that exits is started again (after a pause that
grows while it keeps dying young); on stop, every one drains its calls and exits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from service.frontends.host_limits import ParentTally

log = logging.getLogger("paddlequic.frontends")

FIRST_DELAY_S = 0.2
MAX_DELAY_S = 10.0
YOUNG_S = 10.0  # a front-end that exits sooner than this is restarted after a longer pause
KILL_AFTER_S = 5.0  # past the grace period, a front-end still running is killed


class RestartBackoff:
    """The pause before one front-end is started again, from how long each run lived:
    FIRST_DELAY_S, doubling up to MAX_DELAY_S while it keeps exiting younger than YOUNG_S,
    back to FIRST_DELAY_S after a run that lived longer."""

    def __init__(self) -> None:
        self._delay = FIRST_DELAY_S

    def pause(self, lived_s: float) -> float:
        """A run that lived `lived_s` exited: the pause before the next one."""
        if lived_s >= YOUNG_S:
            self._delay = FIRST_DELAY_S
        pause = self._delay
        self._delay = min(pause * 2, MAX_DELAY_S)
        return pause


class Supervisor:
    def __init__(
        self, count: int, runtime_dir: Path, on_restart: Callable[[], None], tally: ParentTally
    ) -> None:
        """`tally`: the limits the front-ends keep together; each is given its descriptor,
        and a dead one's counts are cleared before its successor starts."""
        self._count = count
        self._runtime_dir = runtime_dir
        self._on_restart = on_restart
        self._tally = tally
        self._processes: dict[int, asyncio.subprocess.Process] = {}
        self._keepers: list[asyncio.Task[None]] = []
        self._stopping = False

    def start(self) -> None:
        self._keepers = [asyncio.create_task(self._keep(i)) for i in range(self._count)]

    def pids(self) -> list[int]:
        return [p.pid for p in self._processes.values()]

    def kill(self, index: str) -> None:
        """A front-end that must not go on (it is started again, as one that died)."""
        process = self._processes.get(int(index))
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    async def _keep(self, index: int) -> None:
        backoff = RestartBackoff()
        while not self._stopping:
            started = time.monotonic()
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "service.frontends.frontend",
                "--index",
                str(index),
                "--runtime-dir",
                str(self._runtime_dir),
                "--tally-fd",
                str(self._tally.fd),
                pass_fds=(self._tally.fd,),
            )
            self._processes[index] = process
            if self._stopping:  # stop() began while this one was starting
                process.send_signal(signal.SIGTERM)
            code = await process.wait()
            self._tally.ended(index)
            if self._stopping:
                return
            delay = backoff.pause(time.monotonic() - started)
            log.warning(
                "front-end %d (pid %d) exited with %s; restarting in %.1f s",
                index,
                process.pid,
                code,
                delay,
            )
            self._on_restart()
            await asyncio.sleep(delay)

    async def stop(self, grace: float) -> None:
        """SIGTERM to every front-end (each lets its calls finish within `grace`), then
        SIGKILL to any still running."""
        self._stopping = True
        running = [p for p in self._processes.values() if p.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        waits = [asyncio.create_task(p.wait()) for p in running]
        if waits:
            _, late = await asyncio.wait(waits, timeout=grace + KILL_AFTER_S)
            for process in running:
                if process.returncode is None:
                    log.warning("front-end pid %d did not stop; killing it", process.pid)
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            if late:
                await asyncio.wait(late)
        for keeper in self._keepers:
            keeper.cancel()
        self._tally.close()
