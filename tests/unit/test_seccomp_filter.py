"""The seccomp filter's program, run by a small classic-BPF interpreter for the instructions it
uses: for both architectures, every system call it names fails with EPERM, every other one
is allowed, and a call made under another architecture or ABI (x32) kills the process; clone3
answers ENOSYS, clone with a namespace flag EPERM, and a new process (fork, vfork, clone
without CLONE_THREAD) EPERM unless children are allowed, a thread never. The e2e tests
(test_python_sandbox.py, test_worker_processes.py) run it in the kernel on this machine's
architecture."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.backend.sandbox import seccomp
from tests.unit.test_validation import property_settings

ALLOW, KILL, EPERM, ENOSYS = 0x7FFF0000, 0x80000000, 0x00050001, 0x00050026
ARCHES = sorted(seccomp._ARCHES)
HEADERS = {
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),
}


# pthread_create's flags (glibc), fork's (glibc's _Fork), posix_spawn's (vfork-like)
THREAD = 0x3D0F00
FORK = 0x01200011
SPAWN = 0x4111
NAMESPACES = [1 << bit for bit in (17, 25, 26, 27, 28, 29, 30)]


def run(program: list[tuple[int, int, int, int]], nr: int, arch: int, flags: int = 0) -> int:
    data = struct.pack("<iIQQ", nr, arch, 0, flags)  # nr, arch, instruction pointer, args[0]
    accumulator, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        pc += 1
        if code == 0x20:  # ld [k]
            (accumulator,) = struct.unpack_from("<I", data, k)
        elif code == 0x15:  # jeq #k
            pc += jt if accumulator == k else jf
        elif code == 0x35:  # jge #k
            pc += jt if accumulator >= k else jf
        elif code == 0x45:  # jset #k
            pc += jt if accumulator & k else jf
        elif code == 0x06:  # ret #k
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")


@pytest.mark.parametrize("machine", ARCHES)
def test_every_named_call_is_refused(machine: str) -> None:
    arch, _, numbers, _, _ = seccomp._ARCHES[machine]
    program = seccomp.program(machine, children=False)
    assert {name: run(program, nr, arch) for name, nr in numbers.items()} == dict.fromkeys(
        numbers, EPERM
    )
    assert len(program) < 256  # jumps are one byte


@given(machine=st.sampled_from(ARCHES), nr=st.integers(0, 0x7FFFFFFF), children=st.booleans())
@property_settings(300)
def test_other_calls_pass_and_foreign_ones_kill(machine: str, nr: int, children: bool) -> None:
    arch, _, numbers, foreign_from, processes = seccomp._ARCHES[machine]
    program = seccomp.program(machine, children)
    if nr in processes.values():
        return  # below
    if foreign_from is not None and nr >= foreign_from:
        expected = KILL
    else:
        expected = EPERM if nr in numbers.values() else ALLOW
    assert run(program, nr, arch) == expected
    other = next(a for m, (a, *_) in seccomp._ARCHES.items() if m != machine)
    assert run(program, nr, other) == KILL


@pytest.mark.parametrize("machine", ARCHES)
def test_numbers_are_the_kernel_headers(machine: str) -> None:
    header = HEADERS[machine]
    if not header.exists():
        pytest.skip(f"{header} is not installed (linux-libc-dev)")
    defined = dict(re.findall(r"#define __NR_(\w+)\s+(\d+)", header.read_text()))
    for numbers in (seccomp._ARCHES[machine][2], seccomp._ARCHES[machine][4]):
        assert {name: int(defined[name]) for name in numbers} == numbers


@pytest.mark.parametrize("machine", ARCHES)
@pytest.mark.parametrize("children", [False, True])
def test_processes_threads_and_namespaces(machine: str, children: bool) -> None:
    arch, _, _, _, processes = seccomp._ARCHES[machine]
    program = seccomp.program(machine, children)
    process = ALLOW if children else EPERM
    clone = processes["clone"]
    assert run(program, processes["clone3"], arch, FORK) == ENOSYS
    assert run(program, clone, arch, THREAD) == ALLOW
    assert run(program, clone, arch, FORK) == process
    assert run(program, clone, arch, SPAWN) == process
    for name in ("fork", "vfork"):
        if name in processes:
            assert run(program, processes[name], arch) == process
    for flag in NAMESPACES:
        assert run(program, clone, arch, FORK | flag) == EPERM
        assert run(program, clone, arch, THREAD | flag) == EPERM


@given(machine=st.sampled_from(ARCHES), flags=st.integers(0, 0xFFFFFFFF), children=st.booleans())
@property_settings(300)
def test_clone_by_its_flags(machine: str, flags: int, children: bool) -> None:
    arch, _, _, _, processes = seccomp._ARCHES[machine]
    verdict = run(seccomp.program(machine, children), processes["clone"], arch, flags)
    if flags & seccomp.CLONE_NEW_NAMESPACES:
        assert verdict == EPERM
    elif flags & seccomp.CLONE_THREAD or children:
        assert verdict == ALLOW
    else:
        assert verdict == EPERM
