"""Large buffers go back to the system when freed, in the processes that hold calls (the
server, each front-end).

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
