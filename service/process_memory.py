"""Large buffers go back to the system when freed, in the processes that hold calls (the
server, each front-end), and a front-end hands back what its allocator kept once a burst of
calls is over (`FreedMemory`).

glibc serves an allocation of 128 KiB or more with its own mmap, returned at free, but after
such a block is freed it raises that threshold to the block's size (up to 32 MiB): the next
buffers of that size come from the heap, grow there by copying (a request body arriving in
chunks held twice while it is copied) and stay in the process once freed. Measured with the
chaos row "REST oversized bodies": a server that refused 16 MiB bodies now and then grew by
33 MB, twice the body. Setting the threshold fixes it where it starts: large buffers are
mapped, grow in place (mremap) and are unmapped when freed."""

from __future__ import annotations

import ctypes
import logging
import math

log = logging.getLogger("paddlequic.memory")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 128 << 10  # glibc's own starting value, kept fixed


def release_large_buffers() -> bool:
    """Whether the threshold is now fixed (False: not glibc, or it refused)."""
    # The process's own symbols: find_library("c") would run ldconfig, ~10 ms per start.
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:  # another C library (musl): it keeps no such threshold
        return False
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD) failed: large freed buffers may stay in memory")
        return False
    return True


def release_freed_memory() -> bool:
    """Hand the pages glibc keeps free, in every arena and in the middle of its heaps, back
    to the system (malloc_trim); whether it could (False: not glibc)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


class FreedMemory:
    """When a front-end calls release_freed_memory: once, after what its calls move has stood
    still for `quiet_s`. Buffers below the mmap threshold (gRPC's slices, 64 KiB requests)
    stay in glibc's arenas once freed: the never-reading-streams chaos row left a front-end
    20-30 MB larger after each attack, nearly all of it free memory malloc_trim gave back.
    Never while calls move, where the allocator reuses it (and trimming costs a walk of
    every arena)."""

    def __init__(self, quiet_s: float) -> None:
        self._quiet_s = quiet_s
        self._last: object = None
        self._moved_at = -math.inf
        self._trimmed = True  # nothing to hand back before the first call

    def due(self, now: float, moved: object) -> bool:
        """`moved`: what changes whenever calls did (compared by ==)."""
        if moved != self._last:
            self._last, self._moved_at, self._trimmed = moved, now, False
            return False
        if self._trimmed or now - self._moved_at < self._quiet_s:
            return False
        self._trimmed = True
        return True
