"""Wake-ups between the process holding calls and a worker: eventfds, one per direction, so a
side that waits sleeps in the kernel (an idle server spends no CPU) and a side that writes many
records wakes the other once for all of them."""

from __future__ import annotations

import contextlib
import os


def make() -> int:
    """Non-blocking on both sides (the flag travels with the descriptor)."""
    return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)


def wake(fd: int) -> None:
    os.eventfd_write(fd, 1)


def clear(fd: int) -> None:
    """Take the wake-ups that came (none: nothing to take)."""
    with contextlib.suppress(BlockingIOError):
        os.eventfd_read(fd)
