"""Triton's system shared-memory extension for every protocol (gRPC's servicer and the REST
routes are conversions around it): who may use it, who the caller is, and an input read from or
an output written to a registered region, so the tensor never travels in the message.

Who may use it is `--shared-memory`: `local` (the default) serves the calls, and requests
whose tensors name regions, only to callers on the server's own host (a loopback peer, IPv4 or
IPv6, also as an IPv4-mapped address on a dual-stack listener): a region is the memory of a
process beside the server, and only such callers can have made one; `any` also serves peers by
other addresses (a trusted network, behind the `shared-memory` restricted-protocol category,
which covers every request whose tensors name a region); `off` refuses them all. Whatever the
mode, a caller is the uid that owns its socket on this host (socket_owners.py): one whose
socket is not on this host, or whose owner cannot be told, uses no region.

CUDA shared memory is answered as Triton built without GPU support answers it (its clients
unregister every CUDA region before they start): no region ever registers, so the status lists
none and unregistering succeeds; registering fails, naming the region. The same modes admit
these calls."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import pwd
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol

import grpc

from oip.datatypes import BY_NAME
from service.inference import errors
from service.inference.jobs import OutputTensor
from service.inference.shared_memory import Caller, Region, SharedMemoryRegions
from service.inference.socket_owners import Address, canonical, exact_owner, socket_owner

MODES = ("off", "local", "any")
REGION, BYTE_SIZE, OFFSET = (
    "shared_memory_region",
    "shared_memory_byte_size",
    "shared_memory_offset",
)


@dataclass(frozen=True)
class Placement:
    """Where one tensor lies: a region, and the bytes at an offset in it."""

    region: str
    byte_size: int
    offset: int


@dataclass(frozen=True)
class Peer:
    """A call's other end, as its protocol knows it."""

    socket: tuple[Address, int] | None  # its address and port (None: not an IP socket)
    text: str  # how errors name it
    transport: str  # how errors name its socket: "TCP (HTTP/2)", "UDP (HTTP/3)", ...
    datagram: bool = False  # a UDP socket (HTTP/3)
    # The one address and port a TCP call can have reached (the connection's own end, or a
    # listener bound to one address on a port given): the owner is found by one exact lookup.
    server: tuple[Address, int] | None = None
    listener_port: int = 0  # a wildcard listener's port (socket_owner's first guess)

    @property
    def local(self) -> bool:
        """A loopback address: 127.0.0.0/8, ::1, or an IPv4 loopback address mapped into IPv6
        (an IPv4 caller of a dual-stack listener)."""
        return self.socket is not None and canonical(self.socket[0]).is_loopback


class RegionMirror(Protocol):
    """Other processes that serve requests naming regions (front-ends), each with its copy of
    the registry (service/frontends/region_copies.py)."""

    async def registered(self, region: Region) -> None:
        """Told to each; waits a moment for them to hold it (one that does not yet passes
        such requests on to this process)."""

    async def unregistered(self, regions: Sequence[Region]) -> None:
        """Told to each; returns once none may use them any more."""


class SharedMemory:
    """The registered regions and who may use them."""

    def __init__(self, mode: str, regions: SharedMemoryRegions | None = None) -> None:
        self.mode = mode
        self.regions = regions or SharedMemoryRegions()
        self.mirror: RegionMirror | None = None

    async def register(
        self, caller: Caller, name: str, key: str, offset: int, byte_size: int
    ) -> None:
        region = self.regions.register(caller, name, key, offset, byte_size)
        if self.mirror is not None:
            await self.mirror.registered(region)

    async def unregister(self, caller: Caller, name: str) -> None:
        """Answered once no process serves a request on the regions any more (a request
        holding one already finishes with it)."""
        dropped = self.regions.unregister(caller, name)
        if dropped and self.mirror is not None:
            await self.mirror.unregistered(dropped)

    def check_mode(self, peer: Peer) -> None:
        """Whether this caller may use shared memory at all (--shared-memory)."""
        if self.mode == "off":
            raise errors.failed_precondition(
                "system shared memory is off on this server (--shared-memory off)"
            )
        if self.mode == "local" and not peer.local:
            raise errors.ServiceError(
                grpc.StatusCode.PERMISSION_DENIED,
                "system shared memory is served to callers on the server's host only "
                "(--shared-memory local); this call came from another host",
            )

    async def caller(self, peer: Peer) -> Caller:
        """Who calls, if it may use shared memory: the uid that owns its socket."""
        self.check_mode(peer)
        uid = None
        if peer.socket is not None:
            address, port = peer.socket
            lookup = (address, port, peer.datagram, peer.server)
            settled, uid = exact_owner(*lookup, peer.listener_port)
            if not settled:  # the tables: milliseconds, off the event loop
                uid = await asyncio.to_thread(
                    socket_owner, *lookup, listener_port=peer.listener_port
                )
        if uid is None:
            raise errors.ServiceError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"system shared memory is served to processes on the server's host, known by "
                f"the uid that owns their socket; no single uid owns the {peer.transport} "
                f"socket of this call's peer '{errors.echoed(peer.text)}' on this host",
            )
        return Caller(uid, _groups(uid))

    def cuda_status(self, peer: Peer, name: str) -> None:
        """No CUDA region is ever registered: every one (none), or the one named, in Triton's
        words."""
        self.check_mode(peer)
        if name:
            raise errors.not_found(
                f"Unable to find cuda shared memory region: '{errors.echoed(name)}' (this "
                "server registers no CUDA shared memory)"
            )

    def cuda_register(self, peer: Peer, name: str) -> NoReturn:
        self.check_mode(peer)
        raise errors.invalid(
            f"failed to register CUDA shared memory region: '{errors.echoed(name)}', GPUs not "
            "supported; this server takes tensors in system shared memory "
            "(SystemSharedMemoryRegister)"
        )

    def read_input(
        self,
        caller: Caller,
        where: Placement,
        name: str,
        datatype: str,
        shape: Sequence[int],
        max_bytes: tuple[int, str],
    ) -> bytes:
        """An input's bytes from its region: what a numeric input's shape and datatype
        declare, and a BYTES input's `shared_memory_byte_size` (its elements serialized as
        tritonclient writes them, each a 4-byte little-endian length and its bytes, which the
        validator then walks as it walks raw contents); either at most `max_bytes` (what a
        message may carry, and the flag that says so), refused before anything is read."""
        size = _bytes_to_read(name, datatype, shape, where, max_bytes)
        with self.regions.using(caller, where.region) as region:
            return region.read(where.offset, size)

    @contextlib.contextmanager
    def held(self, caller: Caller, targets: Mapping[str, Placement]) -> Iterator[None]:
        """The regions outputs go to, held (their descriptors open) until the response is
        built."""
        with contextlib.ExitStack() as stack:
            for where in targets.values():
                stack.enter_context(self.regions.using(caller, where.region, write=True))
            yield

    def write_outputs(
        self,
        outputs: tuple[OutputTensor, ...],
        targets: Mapping[str, Placement],
        caller: Caller | None,
    ) -> tuple[OutputTensor, ...]:
        """Write the outputs that go to regions; those come back with no data."""
        if not targets or caller is None:
            return outputs
        answered = []
        for tensor in outputs:
            where = targets.get(tensor.name)
            if where is None:
                answered.append(tensor)
                continue
            if len(tensor.data) > where.byte_size:
                raise errors.invalid(
                    f"output '{tensor.name}' has {len(tensor.data)} bytes; its region offers "
                    f"{where.byte_size}"
                )
            with self.regions.using(caller, where.region, write=True) as region:
                region.write(where.offset, tensor.data)
            answered.append(dataclasses.replace(tensor, data=b""))
        return tuple(answered)


def _bytes_to_read(
    name: str, datatype_name: str, shape: Sequence[int], where: Placement, limit: tuple[int, str]
) -> int:
    """The bytes of an input to read from its region: a BYTES tensor's are its byte size (its
    elements' lengths are in the region), a numeric one's are what its shape and datatype
    declare, which its byte size must equal."""
    datatype = BY_NAME.get(datatype_name)
    if datatype is None:
        raise errors.invalid(
            f"input '{errors.echoed(name)}': unknown datatype '{errors.echoed(datatype_name)}'"
        )
    if datatype.name == "BYTES":
        if where.byte_size > limit[0]:
            raise _too_large(name, limit)
        return where.byte_size
    size = _declared_bytes(name, shape, datatype.numpy.itemsize, limit)
    if where.byte_size != size:
        raise errors.invalid(
            f"input '{errors.echoed(name)}' declares {size} bytes, its {BYTE_SIZE} is "
            f"{where.byte_size}"
        )
    return size


def _declared_bytes(name: str, shape: Sequence[int], itemsize: int, limit: tuple[int, str]) -> int:
    """The bytes a numeric input's shape declares, refused beyond `limit` as soon as the
    product passes it."""
    if any(d < 0 for d in shape):
        raise errors.invalid(f"input '{errors.echoed(name)}' has a negative dimension")
    size = itemsize
    for dim in shape:
        size *= dim
        if size > limit[0]:
            raise _too_large(name, limit)
    return math.prod(shape) * itemsize


def _too_large(name: str, limit: tuple[int, str]) -> errors.ServiceError:
    return errors.ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"input '{errors.echoed(name)}' declares more than {limit[0]} bytes in shared "
        f"memory ({limit[1]})",
    )


GROUPS_FOR_S = 10.0  # how long a uid's groups, read from the user database, are taken as read
MAX_UIDS_KNOWN = 256  # uids whose groups are kept (the oldest read goes first)
_known_groups: dict[int, tuple[float, frozenset[int]]] = {}


def _groups(uid: int) -> frozenset[int]:
    """The groups of `uid` in the user database, which a process of that user has from its
    login; none for a uid the database does not know (then only owner and others' bits
    count). Kept GROUPS_FOR_S: reading the database costs tens of microseconds, on every call
    naming a region, and a running process keeps the groups it had at login anyway."""
    now = time.monotonic()
    known = _known_groups.get(uid)
    if known is not None and now - known[0] < GROUPS_FOR_S:
        return known[1]
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        groups: frozenset[int] = frozenset()
    else:
        groups = frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))
    _known_groups.pop(uid, None)
    while len(_known_groups) >= MAX_UIDS_KNOWN:
        del _known_groups[next(iter(_known_groups))]
    _known_groups[uid] = (now, groups)
    return groups
