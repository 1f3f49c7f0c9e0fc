"""What a root worker gives up before model code runs, and what every process of the server
gives up at start.

A process that is not dumpable has /proc/PID/environ, mem, fd, maps and the like owned by root
and readable only with CAP_SYS_PTRACE, so a model running as the same user cannot read the
server's secrets through them. A root worker drops every capability (effective, permitted,
inheritable, ambient and the bounding set, so nothing it executes gets one back): uid 0
without capabilities cannot ptrace, read /proc of undumpable processes, override file
permissions, raise its hard limits or bind privileged ports.
"""

from __future__ import annotations

import os
from pathlib import Path

from service.sandbox._libc import (
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


def drop_capabilities() -> None:
    last = int(_CAP_LAST.read_text()) if _CAP_LAST.exists() else 40
    for capability in range(last + 1):
        prctl(PR_CAPBSET_DROP, capability)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    capset_empty()


def is_root() -> bool:
    return os.geteuid() == 0
