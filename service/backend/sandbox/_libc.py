"""The few libc calls the sandbox needs that Python's os module lacks."""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [
    ctypes.c_int,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
]

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> int:
    result = int(_libc.prctl(option, arg2, arg3, 0, 0))
    if result < 0:
        raise _error("prctl")
    return result


def syscall(number: int, *args: object) -> int:
    """The raw call; raises OSError with errno on failure."""
    result = int(_libc.syscall(ctypes.c_long(number), *args))
    if result < 0:
        raise _error(f"system call {number}")
    return result


def capset_empty() -> None:
    """No effective, permitted or inheritable capability left in this thread."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    if _libc.capset(header, data) < 0:
        raise _error("capset")


def _error(what: str) -> OSError:
    errno = ctypes.get_errno()
    return OSError(errno, f"{what}: {os.strerror(errno)}")
