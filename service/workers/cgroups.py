"""A cgroup (v2) per worker, where the host lets the server make them: the server's own cgroup
on a cgroup2 mount offers the memory and pids controllers and the server may write it (a
delegated subtree, a container's namespace, or root on a host without systemd's claim).

The server moves itself into a leaf of its cgroup (`paddlequic-server`: a cgroup with
controllers enabled for its children may hold no process) and makes one child per worker with
`memory.max` (swap off; the whole group killed when it runs out, memory.oom.group) and
`pids.max`; the worker's launcher starts the worker in it (subreaper.py), so whatever the worker
starts is counted there, in total.
Where this fails, `unavailable` says why, and the fallback (seccomp, limits, the launcher's
count) bounds workers instead.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
OWN_CGROUP = Path("/proc/self/cgroup")
SERVER_LEAF = "paddlequic-server"
# Tasks (threads and processes) of one worker: Paddle's and oneDNN's thread pools, OpenMP's,
# BLS threads, and the processes a Python model may run.
MAX_WORKER_TASKS = 1024
_NEEDED = ("memory", "pids")


@dataclass
class WorkerCgroups:
    """Where workers' cgroups go (None: nowhere, for the reason in `unavailable`)."""

    parent: Path | None
    unavailable: str = ""

    def __post_init__(self) -> None:
        self._names = itertools.count(1)

    def create(self, instance: str, memory_bytes: int | None) -> Path | None:
        """A fresh cgroup for one start of a worker; None where there are none."""
        if self.parent is None:
            return None
        path = self.parent / f"worker-{os.getpid()}-{next(self._names)}-{_safe(instance)}"
        path.mkdir()
        _write(path / "memory.max", "max" if memory_bytes is None else str(memory_bytes))
        swap = path / "memory.swap.max"
        if swap.exists():
            _write(swap, "0")  # else memory.max would move to swap, not end the worker
        _write(path / "pids.max", str(MAX_WORKER_TASKS))
        group = path / "memory.oom.group"
        if group.exists():
            _write(group, "1")  # out of memory, the whole worker goes, not one of its children
        return path

    @staticmethod
    def remove(path: Path | None) -> None:
        """Once the launcher (the last process in it) has exited."""
        if path is not None:
            with contextlib.suppress(OSError):
                path.rmdir()


def detect(mountinfo: Path = MOUNTINFO, own_cgroup: Path = OWN_CGROUP) -> WorkerCgroups:
    """Workers' cgroups under this process's own, set up for them, or why not."""
    mount = _cgroup2_mount(mountinfo)
    if mount is None:
        return WorkerCgroups(None, "no cgroup2 file system is mounted")
    relative = _own_cgroup(own_cgroup)
    if relative is None:
        return WorkerCgroups(None, "this process is in no cgroup v2 (only v1 hierarchies)")
    base = mount / relative.lstrip("/")
    try:
        offered = (base / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return WorkerCgroups(None, f"{base} cannot be read ({exc.strerror})")
    missing = [c for c in _NEEDED if c not in offered]
    if missing:
        return WorkerCgroups(
            None,
            f"cgroup v2 at {base} offers no {' or '.join(missing)} controller (bound to "
            "cgroup v1 here, or not delegated)",
        )
    enabled = (base / "cgroup.subtree_control").read_text().split()
    if all(c in enabled for c in _NEEDED):
        return WorkerCgroups(base)
    leaf = base / SERVER_LEAF
    try:
        leaf.mkdir(exist_ok=True)
        _write(leaf / "cgroup.procs", str(os.getpid()))
    except OSError as exc:
        return WorkerCgroups(None, f"{base} is not writable by the server ({exc.strerror})")
    try:
        _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in _NEEDED))
    except OSError as exc:
        with contextlib.suppress(OSError):
            _write(base / "cgroup.procs", str(os.getpid()))
            leaf.rmdir()
        return WorkerCgroups(
            None, f"cannot enable memory and pids under {base} ({exc.strerror}: other processes)"
        )
    return WorkerCgroups(base)


def _cgroup2_mount(mountinfo: Path) -> Path | None:
    for line in mountinfo.read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        if fields[separator + 1] == "cgroup2":
            return Path(fields[4])
    return None


def _own_cgroup(own_cgroup: Path) -> str | None:
    for line in own_cgroup.read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def _write(path: Path, text: str) -> None:
    with path.open("w") as file:
        file.write(text)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]
