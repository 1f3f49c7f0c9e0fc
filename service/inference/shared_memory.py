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
segments are unlinked at creation, so no name reaches them.

The server opens objects with its own credentials, so it opens one for a caller only if the
caller's uid could open it itself (object_access.py): read it to register it, write it to
have outputs go there. A region then belongs to that uid: another uid naming it is answered
as if it were never registered, and each uid has its own names and its own limit."""

from __future__ import annotations

import fcntl
import os
import re
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from service.inference import errors
from service.inference.object_access import Access, refusal

SHM_DIR = "/dev/shm"
# Regions one uid has registered at once: each holds an open descriptor of the server's.
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
    owner: int  # the uid that registered it
    read_only: str | None  # why no output may go there (None: outputs may)
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


@dataclass(frozen=True)
class Caller:
    """Who registers or names a region: the uid that owns the caller's socket, and that
    uid's groups."""

    uid: int
    groups: frozenset[int] = frozenset()


class SharedMemoryRegions:
    """The regions registered with this server, by owner and name: a region belongs to the
    uid that registered it, and is unknown to every other."""

    def __init__(self, limit: int = MAX_REGIONS) -> None:
        self._regions: dict[tuple[int, str], Region] = {}
        self._limit = limit

    def register(self, caller: Caller, name: str, key: str, offset: int, byte_size: int) -> Region:
        if not name or len(name) > _NAME_LIMIT:
            raise errors.invalid(f"a region name has 1 to {_NAME_LIMIT} characters")
        if (caller.uid, name) in self._regions:
            raise errors.ServiceError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"shared-memory region '{errors.echoed(name)}' is already registered; "
                "unregister it first",
            )
        if sum(owner == caller.uid for owner, _ in self._regions) >= self._limit:
            raise errors.ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"uid {caller.uid} holds its maximum of {self._limit} shared-memory regions "
                "on this server; unregister one first",
            )
        if not _KEY.fullmatch(key) or key.strip("/") in (".", ".."):
            raise errors.invalid(
                f"shared-memory key '{errors.echoed(key)}' is not a POSIX shared-memory name "
                "(\"/NAME\": letters, digits, '.', '_', '-'; no other '/')"
            )
        if byte_size <= 0:
            raise errors.invalid("a shared-memory region needs a byte_size above 0")
        fd, read_only = _open(key, caller)
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
        region = Region(name, key, offset, byte_size, fd, caller.uid, read_only)
        self._regions[caller.uid, name] = region
        return region

    def unregister(self, caller: Caller, name: str) -> list[Region]:
        """One of the caller's regions, or every one when `name` is empty; an unknown name is
        no error (Triton's behaviour). The regions dropped."""
        if name:
            region = self._regions.get((caller.uid, name))
            dropped = [region] if region is not None else []
        else:
            dropped = self.status(caller, "")
        self._drop(dropped)
        return dropped

    def adopt(self, region: Region) -> None:
        """A region registered elsewhere, with a descriptor of this process's own (a front-
        end's copy of the parent's, region_copies.py): in place of one of the same owner and
        name."""
        self.forget(region.owner, region.name)
        self._regions[region.owner, region.name] = region

    def forget(self, owner: int, name: str) -> None:
        """A region unregistered elsewhere; its descriptor is closed once no request here
        holds it."""
        region = self._regions.get((owner, name))
        self._drop([region] if region is not None else [])

    def holds(self, caller: Caller, names: Iterable[str]) -> bool:
        """Whether every region named is one of the caller's here."""
        return all((caller.uid, name) in self._regions for name in names)

    def __iter__(self) -> Iterator[Region]:
        return iter(list(self._regions.values()))

    def status(self, caller: Caller, name: str) -> list[Region]:
        if not name:
            return [r for (owner, _), r in self._regions.items() if owner == caller.uid]
        return [self._find(caller, name)]

    @contextmanager
    def using(self, caller: Caller, name: str, write: bool = False) -> Iterator[Region]:
        """The caller's region, held (its descriptor stays open) until the request is done
        with it; `write`: an output goes there."""
        region = self._find(caller, name)
        if write and region.read_only is not None:
            raise errors.ServiceError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"shared-memory region '{errors.echoed(name)}' takes no output: {region.read_only}",
            )
        region.users += 1
        try:
            yield region
        finally:
            region.users -= 1
            if region.unregistered and not region.users:
                region.close()

    def close_all(self) -> None:
        """At shutdown: every owner's regions."""
        self._drop(list(self._regions.values()))

    def _find(self, caller: Caller, name: str) -> Region:
        """Another uid's region is answered as a name never registered."""
        region = self._regions.get((caller.uid, name))
        if region is None:
            raise errors.not_found(
                f"shared-memory region '{errors.echoed(name)}' is not registered"
            )
        return region

    def _drop(self, regions: list[Region]) -> None:
        for region in regions:
            del self._regions[region.owner, region.name]
            region.unregistered = True
            if not region.users:
                region.close()


def _open(key: str, caller: Caller) -> tuple[int, str | None]:
    """A descriptor of the object, if the caller could read it itself, and why it may not
    write it (None: it may). The descriptor is what the caller may do with the object and no
    more: read-only when the caller, or the server, may not write it."""
    path = os.path.join(SHM_DIR, key.lstrip("/"))
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        try:
            fd = os.open(path, os.O_RDWR | flags)
        except PermissionError:
            fd = os.open(path, os.O_RDONLY | flags)
    except FileNotFoundError:
        raise errors.invalid(f"no shared-memory object '{key}' on the server's host") from None
    except OSError as exc:
        raise errors.invalid(
            f"shared-memory object '{key}' cannot be opened: {exc.strerror}"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise errors.invalid(f"shared-memory object '{key}' is not a regular file")
        if _has_acl(fd):
            raise _denied(key, "it carries an access control list, which the server does not read")
        owner = (caller.uid, caller.groups, info.st_uid, info.st_gid, info.st_mode)
        unreadable = refusal(*owner, Access.READ)
        if unreadable is not None:
            raise _denied(key, unreadable)
        read_only = refusal(*owner, Access.WRITE)
        if read_only is None and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
            read_only = "the server may not write its object"
    except BaseException:
        os.close(fd)
        raise
    return fd, read_only


def _has_acl(fd: int) -> bool:
    try:
        os.getxattr(fd, "system.posix_acl_access")
    except OSError:
        return False  # none (ENODATA), or a file system without them
    return True


def _denied(key: str, why: str) -> errors.ServiceError:
    return errors.ServiceError(
        grpc.StatusCode.PERMISSION_DENIED,
        f"shared-memory object '{key}' is not the caller's to use: {why}",
    )
