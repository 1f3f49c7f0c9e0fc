"""What a worker holds of its own: the private memory (USS: private clean + private dirty,
from /proc/PID/smaps_rollup) of its launcher and every process beneath it, which is what its
exit gives back. Pages shared with other processes (a preloaded launcher's Paddle, the
libraries) are not counted: they stay when it goes."""

from __future__ import annotations

from pathlib import Path

from service.workers import subreaper

_PRIVATE = (b"Private_Clean", b"Private_Dirty")


def private_bytes(root: int) -> int:
    """USS of `root` and its descendants, in bytes (a process this server may not read, or
    one gone meanwhile, counts 0)."""
    if root <= 0:
        return 0
    return sum(_private_kb(pid) for pid in (root, *subreaper.descendants(root))) * 1024


def _private_kb(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_bytes()
    except OSError:
        return 0
    total = 0
    for line in text.splitlines():
        key, _, value = line.partition(b":")
        if key in _PRIVATE:
            total += int(value.split()[0])
    return total
