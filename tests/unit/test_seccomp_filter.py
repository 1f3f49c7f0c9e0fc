"""The seccomp filter's program, run by a small classic-BPF interpreter for the instructions it
uses: for both architectures, every system call it names fails with EPERM, every other one
is allowed, and a call made under another architecture or ABI (x32) kills the process. The
e2e test (test_python_sandbox.py) runs it in the kernel on this machine's architecture."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.backend.sandbox import seccomp
from tests.unit.test_validation import property_settings

ALLOW, KILL, EPERM = 0x7FFF0000, 0x80000000, 0x00050001
ARCHES = sorted(seccomp._ARCHES)
HEADERS = {
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),
}


def run(program: list[tuple[int, int, int, int]], nr: int, arch: int) -> int:
    data = struct.pack("<iI", nr, arch)
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
        elif code == 0x06:  # ret #k
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")


@pytest.mark.parametrize("machine", ARCHES)
def test_every_named_call_is_refused(machine: str) -> None:
    arch, _, numbers, _ = seccomp._ARCHES[machine]
    program = seccomp.program(machine)
    assert {name: run(program, nr, arch) for name, nr in numbers.items()} == dict.fromkeys(
        numbers, EPERM
    )
    assert len(program) < 256  # jumps are one byte


@given(machine=st.sampled_from(ARCHES), nr=st.integers(0, 0x7FFFFFFF))
@property_settings(300)
def test_other_calls_pass_and_foreign_ones_kill(machine: str, nr: int) -> None:
    arch, _, numbers, foreign_from = seccomp._ARCHES[machine]
    program = seccomp.program(machine)
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
    numbers = seccomp._ARCHES[machine][2]
    assert {name: int(defined[name]) for name in numbers} == numbers
