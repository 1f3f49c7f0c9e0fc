"""The worker's launcher on its own, with real processes: it exits with its worker's status,
and once the worker ends, however it ends, no process the worker started is left (a double
fork and setsid included); past --children the worker and all its processes are killed and
the launcher says so by its exit status."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from service.workers import subreaper
from tests.servers import alive

# A worker that leaves a grandchild in a session of its own, prints its pid, then runs CODE.
ORPHANING = """
import os, signal, sys, time
if os.fork() == 0:
    if os.fork() == 0:
        os.setsid()
        print(os.getpid(), flush=True)
        while True:
            signal.pause()
    os._exit(0)
os.wait()
time.sleep(0.2)  # the grandchild has printed
{code}
"""
FORKING = """
import os, signal, time
for _ in range({count}):
    if os.fork() == 0:
        signal.pause()
time.sleep(30)
"""
LIMIT_S = 30.0


def launch(code: str, *options: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", subreaper.__name__, *options, "--", sys.executable, "-c"]
    return subprocess.Popen([*command, code], stdout=subprocess.PIPE, text=True)


def orphan_of(launcher: subprocess.Popen[str]) -> int:
    assert launcher.stdout is not None
    return int(launcher.stdout.readline())


def test_the_workers_exit_status_and_no_orphan() -> None:
    launcher = launch(ORPHANING.format(code="sys.exit(7)"))
    orphan = orphan_of(launcher)
    assert launcher.wait(LIMIT_S) == 7
    assert not alive(orphan)


def test_a_worker_killed_by_a_signal() -> None:
    launcher = launch(ORPHANING.format(code="os.kill(os.getpid(), signal.SIGKILL)"))
    orphan = orphan_of(launcher)
    assert launcher.wait(LIMIT_S) == -signal.SIGKILL
    assert not alive(orphan)


def test_sigterm_ends_the_worker_and_everything_beneath_it() -> None:
    """What the front-end sends to end a worker (watchdog, a worker that broke the
    protocol, a stop that took too long)."""
    launcher = launch(ORPHANING.format(code="time.sleep(60)"))
    orphan = orphan_of(launcher)
    worker = subreaper.children_of(launcher.pid)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(LIMIT_S) == -signal.SIGKILL
    assert not alive(orphan) and not any(alive(pid) for pid in worker)


def test_past_the_count_every_process_is_killed() -> None:
    started = time.monotonic()
    launcher = launch(FORKING.format(count=10), "--children", "4")
    assert launcher.wait(LIMIT_S) == subreaper.EXCEEDED_CHILDREN
    assert time.monotonic() - started < LIMIT_S  # not the worker's own 30 s
    assert not subreaper.descendants(launcher.pid)


def test_within_the_count_nothing_happens() -> None:
    launcher = launch(
        FORKING.format(count=3).replace("time.sleep(30)", "time.sleep(1)"), "--children", "4"
    )
    assert launcher.wait(LIMIT_S) == 0


def test_the_front_ends_death_ends_everything() -> None:
    """A front-end killed outright (SIGKILL: no cleanup of its own) leaves no worker and no
    process of one: the kernel sends its launcher SIGTERM (PR_SET_PDEATHSIG)."""
    worker = ORPHANING.format(code="time.sleep(60)")
    front_end = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-m', {subreaper.__name__!r}, '--', sys.executable,"
        f" '-c', {worker!r}])\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", front_end], stdout=subprocess.PIPE, text=True)
    orphan = orphan_of(parent)
    (launcher,) = subreaper.children_of(parent.pid)
    parent.kill()
    parent.wait(LIMIT_S)
    deadline = time.monotonic() + LIMIT_S
    while (alive(orphan) or alive(launcher)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(orphan) and not alive(launcher)
