"""What a root worker gives up before model code runs, and what every process of the server
gives up at start.

A process that is not dumpable has /proc/PID/environ, mem, fd, maps and the like owned by root
and readable only with CAP_SYS_PTRACE, so a model running as the same user cannot read the
server's secrets through them. A root worker changes to an unprivileged user when that user can
read what the worker needs, and drops every capability either way (effective, permitted,
inheritable, ambient and the bounding set, so nothing it executes gets one back): even uid 0
without capabilities cannot ptrace, read /proc of undumpable processes, override file
permissions, raise its hard limits or bind privileged ports; it can still open files root
owns, which Landlock then forbids.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from service.backend.sandbox._libc import (
    PR_CAP_AMBIENT,
    PR_CAP_AMBIENT_CLEAR_ALL,
    PR_CAPBSET_DROP,
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    capset_empty,
    prctl,
)

_CAP_LAST = Path("/proc/sys/kernel/cap_last_cap")


def undumpable() -> None:
    prctl(PR_SET_DUMPABLE, 0)


def no_new_privileges() -> None:
    """Nothing this process executes gains privileges (setuid bits, file capabilities); also
    what lets an unprivileged process install Landlock and seccomp."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def drop_bounding_set() -> None:
    """No capability can come back through execve (needs CAP_SETPCAP: before changing user)."""
    last = int(_CAP_LAST.read_text()) if _CAP_LAST.exists() else 40
    for capability in range(last + 1):
        prctl(PR_CAPBSET_DROP, capability)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)


def unreadable_as(uid: int, gid: int, paths: Iterable[Path]) -> Path | None:
    """The first of `paths` the user could not read (a directory: list and enter), judged by
    the kernel with that user as this process's effective one, for a moment."""
    wanted = [(p, os.R_OK | (os.X_OK if p.is_dir() else 0)) for p in paths if p.exists()]
    os.setgroups([])  # root's groups would answer for it; the worker keeps none either way
    os.setegid(gid)
    os.seteuid(uid)
    try:
        return next((p for p, mode in wanted if not os.access(p, mode, effective_ids=True)), None)
    finally:
        os.seteuid(0)
        os.setegid(0)


def become(uid: int, gid: int) -> None:
    """For good: real, effective and saved ids (after unreadable_as: no groups)."""
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def drop_capabilities() -> None:
    """This thread's effective, permitted and inheritable ones (a process that changed to
    another user has none left already)."""
    capset_empty()


def is_root() -> bool:
    return os.geteuid() == 0
