"""A seccomp filter (hand-written classic BPF: a few dozen instructions need no library) that
makes the system calls model code has no use for fail with EPERM: socket() of every family (no
network, no Unix-socket connect to local daemons; an inherited socket keeps working),
io_uring (which could open sockets past the filter), ptrace and process_vm_*, and the calls
that change mounts, namespaces, kernel modules, keys, BPF programs and perf counters. System
calls of another ABI (x32, 32-bit) kill the process: their numbers are not the ones filtered.

Processes: `clone` with a namespace flag fails like `unshare`; a new process (`fork`, `vfork`,
`clone` without CLONE_THREAD) fails unless the model asked for child processes (their count is
the launcher's to bound, service/workers/subreaper.py); threads are always allowed. `clone3`
answers ENOSYS, which makes the C library fall back to `clone`, whose flags (a number, not a
pointer to a structure as clone3's) the filter can read.
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
# New processes: clone, clone3, and (x86_64 only) fork and vfork.
_X86_64_PROCESSES = {"clone": 56, "clone3": 435, "fork": 57, "vfork": 58}
_AARCH64_PROCESSES = {"clone": 220, "clone3": 435}
# machine -> (AUDIT_ARCH_*, seccomp(2)'s number, system-call numbers, first number of another
# ABI, the calls that start processes)
_ARCHES = {
    "x86_64": (0xC000003E, 317, _X86_64, 0x40000000, _X86_64_PROCESSES),
    "aarch64": (0xC00000B7, 277, _AARCH64, None, _AARCH64_PROCESSES),
}
CLONE_THREAD = 0x00010000
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (clone's flags: 32 bits)
CLONE_NEW_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
CLONE_NEW_NAMESPACES |= 0x20000000 | 0x40000000

_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in seccomp_data (arg 0's low 32 bits: little-endian)
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1

# An instruction whose jumps name labels (resolved by _assemble); a label is a str.
_Symbolic = tuple[int, int | str, int | str, int]


class _Fprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def supported() -> bool:
    return platform.machine() in _ARCHES


def program(machine: str, children: bool) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions; `children`: new processes allowed."""
    arch, _, numbers, foreign_from, processes = _ARCHES[machine]
    code: list[_Symbolic | str] = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 0, "kill", arch),
        (_LD_W_ABS, 0, 0, _NR),
    ]
    if foreign_from is not None:
        code.append((_JGE_K, "kill", 0, foreign_from))
    code.append((_JEQ_K, "enosys", 0, processes["clone3"]))
    code.append((_JEQ_K, "clone", 0, processes["clone"]))
    for name in ("fork", "vfork"):
        if name in processes:
            code.append((_JEQ_K, "process", 0, processes[name]))
    code.extend((_JEQ_K, "eperm", 0, number) for number in sorted(set(numbers.values())))
    code.append((_RET_K, 0, 0, _RET_ALLOW))
    code += ["clone", (_LD_W_ABS, 0, 0, _ARG0), (_JSET_K, "eperm", 0, CLONE_NEW_NAMESPACES)]
    code.append((_JSET_K, "allow", 0, CLONE_THREAD))
    code += ["process", (_RET_K, 0, 0, _RET_ALLOW if children else _RET_ERRNO | errno.EPERM)]
    code += ["allow", (_RET_K, 0, 0, _RET_ALLOW)]
    code += ["eperm", (_RET_K, 0, 0, _RET_ERRNO | errno.EPERM)]
    code += ["enosys", (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS)]
    code += ["kill", (_RET_K, 0, 0, _RET_KILL_PROCESS)]
    return _assemble(code)


def _assemble(code: list[_Symbolic | str]) -> list[tuple[int, int, int, int]]:
    """Labels (the strings) to relative jumps: a jump counts the instructions it skips."""
    labels: dict[str, int] = {}
    instructions: list[_Symbolic] = []
    for item in code:
        if isinstance(item, str):
            labels[item] = len(instructions)
        else:
            instructions.append(item)

    def offset(target: int | str, at: int) -> int:
        return target if isinstance(target, int) else labels[target] - at - 1

    return [
        (op, offset(jt, at), offset(jf, at), k) for at, (op, jt, jf, k) in enumerate(instructions)
    ]


def install(children: bool) -> bool:
    """Every thread of this process, from now on and for good; False: this kernel has no
    seccomp filters. The caller has set no_new_privs."""
    machine = platform.machine()
    code = program(machine, children)
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
