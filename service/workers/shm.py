"""Shared-memory segments that carry tensor bytes between the front-end and a worker.

The front-end creates and owns every segment (multiprocessing's resource tracker unlinks them
if the front-end dies); workers only map them by name, so a worker crash leaks nothing.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Iterable
from multiprocessing import shared_memory

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
        size = max(MIN_SEGMENT, size)
        self._shm = shared_memory.SharedMemory(
            name=f"paddlequic-{os.getpid()}-{secrets.token_hex(6)}", create=True, size=size
        )
        self.name = self._shm.name
        self.size = size
        try:
            fd = os.open(f"/dev/shm/{self.name}", os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError:
            self.release()
            raise

    @property
    def buf(self) -> memoryview:
        buf = self._shm.buf
        assert buf is not None
        return buf

    def release(self) -> None:
        self._shm.close()
        self._shm.unlink()


class Mapping:
    """A worker's view of a segment, mapped from /dev/shm without the resource tracker."""

    def __init__(self, name: str) -> None:
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.name = name

    def close(self) -> None:
        self.map.close()


class MappingCache:
    """Maps each segment once, and drops mappings of segments the front-end has unlinked."""

    def __init__(self) -> None:
        self._maps: dict[str, Mapping] = {}

    def get(self, name: str) -> mmap.mmap:
        if name not in self._maps:
            for stale in [n for n in self._maps if not os.path.exists(f"/dev/shm/{n}")]:
                self._maps.pop(stale).close()
            self._maps[name] = Mapping(name)
        return self._maps[name].map
