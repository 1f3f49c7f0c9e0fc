"""Shared-memory segments that carry tensor bytes between the front-end and a worker.

The front-end creates every segment in /dev/shm (whose size the deployment sets) and unlinks it
at once: no other process (another model's worker, another local user) can open it by name, a
crash of either side leaks nothing, and the worker gets it as a file descriptor passed over a
socket of its own (SCM_RIGHTS), never by a path.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
from collections.abc import Iterable

ALIGN = 64
MIN_SEGMENT = 1 << 20


def aligned(size: int) -> int:
    return (size + ALIGN - 1) // ALIGN * ALIGN


def layout(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Offsets for consecutive tensors, each 64-byte aligned, and the total size."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += aligned(size)
    return offsets, total


class Segment:
    """A front-end owned segment, replaced by a bigger one when a request does not fit.

    Its memory is reserved when it is made: a segment only sized (ftruncate) would be sparse,
    and touching a page that /dev/shm has no room for kills the process with SIGBUS. Reserving
    turns a full /dev/shm into an OSError (ENOSPC) here instead."""

    def __init__(self, size: int) -> None:
        self.size = max(MIN_SEGMENT, size)
        self.name = f"paddlequic-{os.getpid()}-{secrets.token_hex(6)}"
        path = f"/dev/shm/{self.name}"
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.unlink(path)
        try:
            os.posix_fallocate(self.fd, 0, self.size)
            self._map = mmap.mmap(self.fd, self.size)
        except OSError:
            os.close(self.fd)
            raise
        self.buf = memoryview(self._map)

    def send(self, channel: socket.socket) -> None:
        """Hand the worker at the other end of `channel` this segment's descriptor."""
        socket.send_fds(channel, [self.name.encode()], [self.fd])

    def release(self) -> None:
        self.buf.release()
        self._map.close()
        os.close(self.fd)


class MappingCache:
    """A worker's mappings of the segments the front-end passed it, by name."""

    def __init__(self, channel: socket.socket) -> None:
        self._channel = channel
        self._maps: dict[str, mmap.mmap] = {}

    def get(self, name: str) -> mmap.mmap:
        """Descriptors arrive in the order the front-end sent them, each before the first
        message that names it."""
        while name not in self._maps:
            data, fds, _, _ = socket.recv_fds(self._channel, 256, 1)
            if not fds:
                raise ConnectionError("the front-end closed the segment channel")
            try:
                self._maps[data.decode()] = mmap.mmap(fds[0], os.fstat(fds[0]).st_size)
            finally:
                os.close(fds[0])
        return self._maps[name]

    def retire(self, names: Iterable[str]) -> None:
        for name in names:
            mapping = self._maps.pop(name, None)
            if mapping is not None:
                mapping.close()
