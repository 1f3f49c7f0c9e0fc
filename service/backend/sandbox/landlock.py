"""Landlock (Linux 5.13 and later), through its system calls (Python has no binding).

Once `restrict` returns, this thread and every process it starts may open only what lies
beneath the paths it allowed, in the ways it allowed them; with ABI 4 (Linux 6.7) no TCP
connect or bind at all; with ABI 6 (Linux 6.12) no signal to, and no abstract Unix socket of, a
process outside the sandbox. Landlock also refuses ptrace access to processes outside the
sandbox, which covers /proc/PID/environ, mem and fd of the server and its other workers.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from service.backend.sandbox._libc import syscall

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same on every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
TRUNCATE, IOCTL_DEV = 1 << 14, 1 << 15
READ = EXECUTE | READ_FILE | READ_DIR
READ_WRITE = READ | WRITE_FILE | TRUNCATE
# Rights that make sense on a file (the rest are about directories' entries).
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
_NET_TCP = 0b11  # bind, connect
_SCOPES = 0b11  # abstract Unix sockets, signals


class _RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


def abi() -> int:
    """The Landlock ABI this kernel offers; 0: none (too old, not enabled at boot, or the
    call refused by a container's seccomp profile)."""
    try:
        return syscall(_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION)
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
            return 0
        raise


def handled_fs(version: int) -> int:
    """Every file-system right the ABI knows: what is not allowed below is denied."""
    last = {1: 12, 2: 13, 3: 14, 4: 14}.get(version, 15)
    return (1 << (last + 1)) - 1


def restrict(allowed: Iterable[tuple[Path, int]], version: int) -> None:
    """Confine this thread to `allowed` (path, rights); paths that do not exist are skipped.
    The caller has set no_new_privs (or holds CAP_SYS_ADMIN)."""
    fs = handled_fs(version)
    attr = _RulesetAttr(fs, _NET_TCP if version >= 4 else 0, _SCOPES if version >= 6 else 0)
    ruleset = syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    try:
        for path, rights in allowed:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    rights &= _FILE_RIGHTS
                rule = _PathBeneathAttr(rights & fs, fd)
                syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0)
            finally:
                os.close(fd)
        syscall(_RESTRICT_SELF, ruleset, 0)
    finally:
        os.close(ruleset)
