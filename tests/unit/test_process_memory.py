"""Large buffers freed in a server process go back to the system (service/process_memory.py):
a body grown in chunks to 16 MiB and freed, four times over, leaves the process's resident
memory where it was. Without it (glibc's adaptive threshold) the same process keeps about
18 MiB: the body's size, in the heap. Smaller buffers stay in the heap once freed: a front-end
hands them back once its calls stand still (FreedMemory, release_freed_memory)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from service.process_memory import FreedMemory
from tests.servers import REPO_ROOT

# What each script reads its memory with: a /proc/self/status field, in MiB.
MIB = """
def mib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
"""

GROW = """
import json, sys
from service.process_memory import release_large_buffers
rss_mib = lambda: mib("VmRSS")

fixed = release_large_buffers() if sys.argv[1] == "fixed" else False
before = rss_mib()
for _ in range(4):
    body = bytearray()
    for _ in range(16):
        body += b"x" * (1 << 20)
    del body
print(json.dumps({"fixed": fixed, "kept_mib": rss_mib() - before}))
"""


TRIM = """
import json
from service.process_memory import release_freed_memory
anon_mib = lambda: mib("RssAnon")

buffers = [bytearray(b"x" * (64 << 10)) for _ in range(480)]  # 30 MiB, each its own malloc
kept = buffers.pop()  # above the others: the heap's top cannot shrink past it
before = anon_mib()
buffers.clear()
held = anon_mib()
trimmed = release_freed_memory()
released = held - anon_mib()
print(json.dumps({"trimmed": trimmed, "freed_mib": before - held, "released_mib": released}))
"""


def kept(mode: str, script: str = GROW) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", MIB + script, mode],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        check=True,
    )
    result: dict[str, float] = json.loads(done.stdout)
    return result


def test_a_freed_body_leaves_no_memory_behind() -> None:
    fixed = kept("fixed")
    assert fixed["fixed"] is True  # the server's hosts run glibc
    assert fixed["kept_mib"] < 4


def test_freed_small_buffers_go_back_to_the_system_once_trimmed() -> None:
    """64 KiB buffers (below the threshold) stay in the heap once freed; malloc_trim hands
    their pages back."""
    result = kept("", TRIM)
    assert result["trimmed"] is True
    assert result["freed_mib"] < 8, "glibc gave most of it back at free: nothing to show"
    assert result["released_mib"] > 16


@given(st.lists(st.tuples(st.floats(0.0, 10.0), st.integers(0, 2)), min_size=1, max_size=40))
def test_memory_is_handed_back_once_per_burst_after_its_calls_stand_still(
    steps: list[tuple[float, int]],
) -> None:
    """Never while the calls move, once when they have stood still for the quiet span, and
    not again until they move."""
    quiet = 5.0
    freed = FreedMemory(quiet)
    now, last, moved_at, trimmed = 0.0, None, -math.inf, True
    for gap, moved in steps:
        now += gap
        due = freed.due(now, moved)
        if moved != last:
            assert not due
            last, moved_at, trimmed = moved, now, False
        else:
            assert due == (not trimmed and now - moved_at >= quiet)
            trimmed = trimmed or due
