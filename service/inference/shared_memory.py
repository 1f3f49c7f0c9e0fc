"""Regions of POSIX shared memory that callers on the same host registered (Triton's system
shared-memory extension), read for inputs and written for outputs instead of carrying tensors
in the message.

The server never maps a caller's object: its owner can shrink it at any time, and touching a
mapped page past the new end kills the process with SIGBUS. Reads and writes are pread and
pwrite on a descriptor opened at registration, so a shrunk object gives a short read or write,
an error for that request only. A region unregistered while a request uses it keeps its
descriptor until the last such request is done: a descriptor number is never reused under a
request that still holds it. Only shm_open's names are taken (one optional leading `/`, no
other), opened without following links and only if they are regular files; the server's own
segments are unlinked at creation, so no name reaches them."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from service.inference import errors

SHM_DIR = "/dev/shm"
# Regions registered at once: each holds an open descriptor of the server's.
MAX_REGIONS = 64
_KEY = re.compile(r"/?[A-Za-z0-9._-]{1,200}")
_NAME_LIMIT = 128


@dataclass(eq=False)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    users: int = 0
    unregistered: bool = False
    closed: bool = field(default=False, repr=False)

    def read(self, offset: int, size: int) -> bytes:
        """`size` bytes at `offset` within the region; INVALID_ARGUMENT if they are not all
        there (outside the region, or its object shrank)."""
        self._check(offset, size, "input")
        data = os.pread(self.fd, size, self.offset + offset)
        if len(data) != size:
            raise errors.invalid(
                f"shared-memory region '{self.name}' holds only {len(data)} of the {size} bytes "
                f"asked at offset {offset} (its object shrank)"
            )
        return data

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self._check(offset, len(data), "output")
        view = memoryview(data)
        position = self.offset + offset
        while view:
            written = os.pwrite(self.fd, view, position)
            if written <= 0:
                raise errors.invalid(f"shared-memory region '{self.name}' took no more bytes")
            view, position = view[written:], position + written

    def _check(self, offset: int, size: int, what: str) -> None:
        if offset < 0 or size < 0 or offset + size > self.byte_size:
            raise errors.invalid(
                f"{what} of {size} bytes at offset {offset} lies outside shared-memory region "
                f"'{self.name}' ({self.byte_size} bytes)"
            )

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)


class SharedMemoryRegions:
    """The regions registered with this server, by name."""

    def __init__(self, limit: int = MAX_REGIONS) -> None:
        self._regions: dict[str, Region] = {}
        self._limit = limit

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name or len(name) > _NAME_LIMIT:
            raise errors.invalid(f"a region name has 1 to {_NAME_LIMIT} characters")
        if name in self._regions:
            raise errors.ServiceError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"shared-memory region '{errors.echoed(name)}' is already registered; "
                "unregister it first",
            )
        if len(self._regions) >= self._limit:
            raise errors.ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server holds its maximum of {self._limit} shared-memory regions; "
                "unregister one first",
            )
        if not _KEY.fullmatch(key) or key.strip("/") in (".", ".."):
            raise errors.invalid(
                f"shared-memory key '{errors.echoed(key)}' is not a POSIX shared-memory name "
                "(\"/NAME\": letters, digits, '.', '_', '-'; no other '/')"
            )
        if byte_size <= 0:
            raise errors.invalid("a shared-memory region needs a byte_size above 0")
        fd = _open(key)
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise errors.invalid(
                    f"shared-memory object '{key}' has {size} bytes; the region asks for "
                    f"{byte_size} at offset {offset}"
                )
        except BaseException:
            os.close(fd)
            raise
        self._regions[name] = Region(name, key, offset, byte_size, fd)

    def unregister(self, name: str) -> None:
        """One region, or every one when `name` is empty; an unknown name is no error
        (Triton's behaviour)."""
        for region in (
            [self._regions[name]]
            if name in self._regions
            else (list(self._regions.values()) if not name else [])
        ):
            del self._regions[region.name]
            region.unregistered = True
            if not region.users:
                region.close()

    def status(self, name: str) -> list[Region]:
        if not name:
            return list(self._regions.values())
        if name not in self._regions:
            raise errors.not_found(
                f"shared-memory region '{errors.echoed(name)}' is not registered"
            )
        return [self._regions[name]]

    @contextmanager
    def using(self, name: str) -> Iterator[Region]:
        """The region, held (its descriptor stays open) until the request is done with it."""
        region = self._regions.get(name)
        if region is None:
            raise errors.invalid(f"shared-memory region '{errors.echoed(name)}' is not registered")
        region.users += 1
        try:
            yield region
        finally:
            region.users -= 1
            if region.unregistered and not region.users:
                region.close()

    def close_all(self) -> None:
        """At shutdown."""
        self.unregister("")


def _open(key: str) -> int:
    path = os.path.join(SHM_DIR, key.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise errors.invalid(f"no shared-memory object '{key}' on the server's host") from None
    except OSError as exc:
        raise errors.invalid(
            f"shared-memory object '{key}' cannot be opened: {exc.strerror}"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise errors.invalid(f"shared-memory object '{key}' is not a regular file")
    return fd
