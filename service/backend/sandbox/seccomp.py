"""A seccomp filter (hand-written classic BPF: a dozen instructions need no library) that makes
the system calls model code has no use for fail with EPERM: socket() of every family (no
network, no Unix-socket connect to local daemons; an inherited socket keeps working),
io_uring (which could open sockets past the filter), ptrace and process_vm_*, and the calls
that change mounts, namespaces, kernel modules, keys, BPF programs and perf counters. System
calls of another ABI (x32, 32-bit) kill the process: their numbers are not the ones filtered.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

from service.backend.sandbox._libc import syscall

_DENIED = (
    "socket", "ptrace", "process_vm_readv", "process_vm_writev",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "open_by_handle_at", "reboot", "swapon", "swapoff",
)  # fmt: skip
# From the kernel's uapi headers (asm/unistd_64.h; asm-generic/unistd.h for arm64).
_X86_64 = dict(zip(_DENIED, (
    41, 101, 310, 311, 425, 426, 427, 321, 298, 323, 250, 248, 249, 165, 166, 155, 161, 272,
    308, 428, 429, 430, 431, 432, 433, 442, 246, 320, 175, 313, 176, 304, 169, 167, 168,
), strict=True))  # fmt: skip
_AARCH64 = dict(zip(_DENIED, (
    198, 117, 270, 271, 425, 426, 427, 280, 241, 282, 219, 217, 218, 40, 39, 41, 51, 97,
    268, 428, 429, 430, 431, 432, 433, 442, 104, 294, 105, 273, 106, 265, 142, 224, 225,
), strict=True))  # fmt: skip
# machine -> (AUDIT_ARCH_*, seccomp(2)'s number, system-call numbers, first number of another ABI)
_ARCHES = {
    "x86_64": (0xC000003E, 317, _X86_64, 0x40000000),
    "aarch64": (0xC00000B7, 277, _AARCH64, None),
}

_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM = 1
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1


class _Fprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def supported() -> bool:
    return platform.machine() in _ARCHES


def program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions."""
    arch, _, numbers, foreign_from = _ARCHES[machine]
    denied = sorted(set(numbers.values()))
    # seccomp_data: int nr at offset 0, u32 arch at offset 4
    code = [(_LD_W_ABS, 0, 0, 4), (_JEQ_K, 1, 0, arch), (_RET_K, 0, 0, _RET_KILL_PROCESS)]
    code.append((_LD_W_ABS, 0, 0, 0))
    if foreign_from is not None:
        code.append((_JGE_K, len(denied) + 2, 0, foreign_from))  # to the kill below
    for index, number in enumerate(denied):
        code.append((_JEQ_K, len(denied) - index, 0, number))  # to the EPERM below
    code.append((_RET_K, 0, 0, _RET_ALLOW))
    code.append((_RET_K, 0, 0, _RET_ERRNO | _EPERM))
    if foreign_from is not None:
        code.append((_RET_K, 0, 0, _RET_KILL_PROCESS))
    return code


def install() -> bool:
    """Every thread of this process, from now on and for good; False: this kernel has no
    seccomp filters. The caller has set no_new_privs."""
    machine = platform.machine()
    code = program(machine)
    packed = b"".join(struct.pack("HBBI", *instruction) for instruction in code)
    buffer = ctypes.create_string_buffer(packed, len(packed))
    prog = _Fprog(len(code), ctypes.addressof(buffer))
    number = _ARCHES[machine][1]
    try:
        syscall(number, _SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(prog))
    except OSError as exc:
        if exc.errno == errno.ENOSYS:
            return False
        raise
    return True
