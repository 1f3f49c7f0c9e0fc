"""A worker's launcher: `python -m service.workers.subreaper [--children N] [--cgroup DIR] --
COMMAND...` runs COMMAND (the worker) as its child and outlives every process the worker
starts, so that none survives it.

It is a child subreaper (PR_SET_CHILD_SUBREAPER): a process the worker starts that loses its
parent (a double fork, a `setsid`) becomes the launcher's child, not init's. When the worker
ends, however it ends, the launcher kills every process left beneath it and only then exits,
with the worker's status. The front-end ends a worker by sending its launcher SIGTERM
(`stop`); a launcher whose front-end dies gets SIGTERM from the kernel (PR_SET_PDEATHSIG).

With `--children N` (a Python model's python_child_processes) the launcher counts the
processes beneath the worker every CHECK_INTERVAL_S and kills them all, the worker with them,
past N; it then exits with EXCEEDED_CHILDREN. With `--cgroup DIR` the worker starts in that
cgroup (its limits set by the front-end, cgroups.py), so everything it starts is counted there;
the launcher stays outside, so that it outlives the kernel's killing the whole group for memory
(memory.oom.group), and then exits with EXCEEDED_MEMORY.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

from service.backend.sandbox._libc import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, prctl

# The worker command of a launcher forked from the preloaded launcher (preloaded.py): the
# worker runs service.workers.main in the forked process, Paddle already imported, no exec.
IN_PROCESS = "<preloaded worker>"
CHECK_INTERVAL_S = 0.1  # a scan of /proc costs about 3 ms for 120 processes
EXCEEDED_CHILDREN = 90  # exit status: the worker's processes went past --children
EXCEEDED_MEMORY = 91  # exit status: the kernel killed a process of its cgroup for memory
# Exit status the server gives a launcher that ended with the preloaded launcher which forked
# it (forked.py): the server's doing, not the model's or the request's.
ENDED_WITH_PRELOADED = 92
# The same for a launcher that ended with the model template which forked it (templates.py).
ENDED_WITH_TEMPLATE = 93


class _Stop(Exception):
    """SIGTERM: end the worker and everything beneath it."""


def _stop(signum: int, frame: object) -> None:
    raise _Stop


def children_of(parent: int) -> list[int]:
    return _children().get(parent, [])


def descendants(root: int) -> list[int]:
    """Every process beneath `root`, from one scan of /proc."""
    children = _children()
    found, frontier = [], [root]
    while frontier:
        below = children.get(frontier.pop(), [])
        found.extend(below)
        frontier.extend(below)
    return found


def _children() -> dict[int, list[int]]:
    """Each process's children, from a scan of /proc (this kernel may not offer
    /proc/PID/task/TID/children)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile
        try:
            stat = os.read(fd, 512)
        except OSError:
            continue
        finally:
            os.close(fd)
        # pid (comm) state ppid ...: comm may hold spaces and parentheses
        ppid = int(stat[stat.rindex(b")") + 2 :].split(None, 2)[1])
        children.setdefault(ppid, []).append(int(name))
    return children


def kill_all(cgroup: Path | None) -> None:
    """Kill and reap every process beneath this one, and every other one in its cgroup.
    Orphans of the ones killed become this process's children too: repeat until none is
    left."""
    me = os.getpid()
    while True:
        children = set(children_of(me))
        remaining = (children | _members(cgroup)) - {me}
        if not remaining:
            return
        for pid in remaining:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # quick: SIGKILL cannot be caught or ignored
        if not children:
            time.sleep(0.001)  # only members of the cgroup this process cannot wait for


def _members(cgroup: Path | None) -> set[int]:
    if cgroup is None:
        return set()
    try:
        return {int(pid) for pid in (cgroup / "cgroup.procs").read_text().split()}
    except OSError:
        return set()


def wait_for(worker: int, children: int | None) -> int:
    """The worker's wait status, reaping the orphans given to this process meanwhile; with a
    count, EXCEEDED_CHILDREN (as an exit status) once the worker's processes pass it. The
    processes beneath it are counted (a scan of /proc: milliseconds) only when the host has
    forked since the last count: no count can grow without a fork."""
    counted_at = -1
    while True:
        if children is None:
            pid, status = os.waitpid(-1, 0)
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                forks = forks_since_boot()
                if forks != counted_at:
                    counted_at = forks
                    if len(descendants(os.getpid())) - 1 > children:
                        return EXCEEDED_CHILDREN << 8
                time.sleep(CHECK_INTERVAL_S)
                continue
        if pid == worker:
            return status


def forks_since_boot() -> int:
    """The host's count of fork and clone calls (/proc/stat `processes`)."""
    with open("/proc/stat", "rb") as stat:
        for line in stat:
            if line.startswith(b"processes "):
                return int(line.split()[1])
    return -2  # never: every Linux has the line; a scan each time otherwise


def _oom_killed(cgroup: Path) -> bool:
    try:
        events = (cgroup / "memory.events").read_text().split()
    except OSError:
        return False
    counts = dict(zip(events[::2], events[1::2], strict=False))
    return int(counts.get("oom_kill", "0")) > 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--children", type=int, default=None)
    parser.add_argument("--cgroup", type=Path, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front-end owns shutdown
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    status = int(
        signal.SIGKILL
    )  # a wait status: as if killed, should SIGTERM come before the worker's end
    try:
        worker = os.fork()
        if worker == 0:
            _become_worker(command, args.cgroup)
        _close_inherited()
        status = wait_for(worker, args.children)
    except _Stop:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kill_all(args.cgroup)
    if args.cgroup is not None and _oom_killed(args.cgroup):
        return EXCEEDED_MEMORY
    if os.WIFSIGNALED(status):  # the same for the front-end
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    return os.waitstatus_to_exitcode(status)


def _become_worker(command: list[str], cgroup: Path | None) -> NoReturn:
    """In the forked child: never returns into the launcher's code, whatever fails."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # should the launcher be killed
        if cgroup is not None:  # the worker's alone: the launcher outlives its OOM kill
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        if command[0] == IN_PROCESS:  # [IN_PROCESS, TITLE, worker options...]
            import setproctitle

            from service.workers import main as worker

            setproctitle.setproctitle(f"paddlequic worker {command[1]}")
            os._exit(worker.main(command[2:]))
        os.execv(command[0], command)
    finally:
        os._exit(127)


def _close_inherited() -> None:
    """The worker's sockets are the worker's: its end is seen by the front-end only when no
    process holds them (stdout and stderr stay, for what the launcher itself reports)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            with contextlib.suppress(OSError):
                os.close(fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
