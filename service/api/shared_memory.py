"""Triton's system shared-memory extension at the protocol's edge: the three RPCs, and the
tensor parameters (`shared_memory_region`, `shared_memory_byte_size`, `shared_memory_offset`)
that make an input read from a registered region and an output written into one, so the
tensor never travels in the message.

Who may use it is `--shared-memory`: `local` (the default) serves the RPCs, and requests whose
tensors name regions, only to callers on the server's own host (a loopback peer, IPv4 or IPv6,
also as an IPv4-mapped address on a dual-stack listener): a region is the memory of a process
beside the server, and only such callers can have made one; `any` also serves peers by other
addresses (a trusted network, behind the `shared-memory` restricted-protocol category, which
covers every request whose tensors name a region); `off` refuses them all. Whatever the mode,
a caller is the uid that owns its socket on this host (socket_owners.py): one whose socket is
not on this host, or whose owner cannot be told, uses no region.

CUDA shared memory is answered as Triton built without GPU support answers it (its clients
unregister every CUDA region before they start): no region ever registers, so the status lists
none and unregistering succeeds; registering fails, naming the region. The same modes and
category admit these RPCs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import math
import os
import pwd
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from oip.datatypes import BY_NAME
from protos.inference import grpc_service_pb2 as pb
from service.api.callers import peer_socket
from service.api.restricted import Restriction
from service.inference import errors
from service.inference.errors import ServicerContext
from service.inference.jobs import OutputTensor
from service.inference.shared_memory import Caller, SharedMemoryRegions
from service.inference.socket_owners import Address, canonical, socket_owner

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


class SharedMemory:
    """The registered regions and who may use them."""

    def __init__(
        self,
        mode: str,
        restriction: Restriction | None = None,
        regions: SharedMemoryRegions | None = None,
        listener: tuple[str, int] = ("0.0.0.0", 0),
    ) -> None:
        """`listener`: the HTTP/2 listener's host and port; bound to one address (and a port
        given), a caller's socket is found by one exact lookup; on a wildcard address, first by
        the lookup of a connection from the caller's address to that same address."""
        self.mode = mode
        self.restriction = restriction  # the `shared-memory` category's, if restricted
        self.regions = regions or SharedMemoryRegions()
        self._server = _one_address(*listener)
        self._listener_port = listener[1]

    async def caller(self, context: ServicerContext) -> Caller:
        """Who calls, if it may use shared memory: the uid that owns its socket."""
        self.check_mode(context)
        peer = context.peer()
        socket = peer_socket(peer)
        # Our own servicer contexts say whether the call came over UDP (HTTP/3); grpc.aio's,
        # which has no such attribute, serves TCP only.
        datagram = bool(getattr(context, "datagram_peer", False))
        uid = (
            None
            if socket is None
            else await asyncio.to_thread(
                socket_owner,
                *socket,
                datagram,
                self._server,
                listener_port=self._listener_port,
            )
        )
        if uid is None:
            raise errors.ServiceError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"system shared memory is served to processes on the server's host, known by "
                f"the uid that owns their socket; no single uid owns the {_label(datagram)} "
                f"socket of this call's peer '{errors.echoed(peer)}' on this host",
            )
        return Caller(uid, _groups(uid))

    async def tensor_caller(
        self, request: pb.ModelInferRequest, context: ServicerContext
    ) -> Caller | None:
        """The caller of a request whose tensors name regions (None: none does), once the
        `shared-memory` restricted category, if any, let it through."""
        if not any(REGION in t.parameters for t in request.inputs) and not any(
            REGION in t.parameters for t in request.outputs
        ):
            return None
        restriction = self.restriction
        if restriction is not None and not restriction.allows(context.invocation_metadata() or ()):
            raise errors.ServiceError(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{restriction.refusal} (this request's tensors name shared-memory regions)",
            )
        return await self.caller(context)

    def check_mode(self, context: ServicerContext) -> None:
        """Whether this caller may use shared memory at all (--shared-memory)."""
        if self.mode == "off":
            raise errors.failed_precondition(
                "system shared memory is off on this server (--shared-memory off)"
            )
        if self.mode == "local" and not local_peer(context.peer()):
            raise errors.ServiceError(
                grpc.StatusCode.PERMISSION_DENIED,
                "system shared memory is served to callers on the server's host only "
                "(--shared-memory local); this call came from another host",
            )

    def status(self, caller: Caller, name: str) -> pb.SystemSharedMemoryStatusResponse:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self.regions.status(caller, name):
            response.regions[region.name].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(
                    name=region.name,
                    key=region.key,
                    offset=region.offset,
                    byte_size=region.byte_size,
                )
            )
        return response

    def cuda_status(self, context: ServicerContext, name: str) -> pb.CudaSharedMemoryStatusResponse:
        """No CUDA region is ever registered: every one, or the one named, in Triton's words."""
        self.check_mode(context)
        if name:
            raise errors.not_found(
                f"Unable to find cuda shared memory region: '{errors.echoed(name)}' (this "
                "server registers no CUDA shared memory)"
            )
        return pb.CudaSharedMemoryStatusResponse()

    def cuda_register(self, context: ServicerContext, name: str) -> NoReturn:
        self.check_mode(context)
        raise errors.invalid(
            f"failed to register CUDA shared memory region: '{errors.echoed(name)}', GPUs not "
            "supported; this server takes tensors in system shared memory "
            "(SystemSharedMemoryRegister)"
        )

    def read_inputs(
        self, request: pb.ModelInferRequest, caller: Caller | None, max_bytes: int
    ) -> list[bytes] | None:
        """Every input's bytes, those that name a region read from it, the others as the
        message carried them (None: no input names a region); the request is then validated
        like any other. The bytes read are what a numeric input's shape and datatype declare,
        and a BYTES input's `shared_memory_byte_size` (its elements serialized as tritonclient
        writes them, each a 4-byte little-endian length and its bytes, which the validator
        then walks as it walks raw contents); either at most `max_bytes` (what a message may
        carry). `caller`: `tensor_caller`'s answer."""
        if caller is None:
            return None
        placements = [placement(t.parameters, "input") for t in request.inputs]
        if not any(placements):
            return None
        raw = list(request.raw_input_contents)
        carried = sum(p is None for p in placements)
        if len(raw) != carried:
            raise errors.invalid(
                f"{len(raw)} raw_input_contents for the {carried} input(s) not in shared "
                "memory; send those as raw_input_contents, in order"
            )
        contents = iter(raw)
        filled = []
        for tensor, where in zip(request.inputs, placements, strict=True):
            if where is None:
                filled.append(next(contents))
                continue
            size = _bytes_to_read(tensor, where, max_bytes)
            with self.regions.using(caller, where.region) as region:
                filled.append(region.read(where.offset, size))
        return filled

    @contextlib.contextmanager
    def output_targets(
        self, request: pb.ModelInferRequest, caller: Caller | None
    ) -> Iterator[dict[str, Placement]]:
        """The outputs the request wants written into the caller's regions, by name; the
        regions stay held (their descriptors open) until the response is built."""
        if caller is None:
            yield {}
            return
        targets = {}
        for output in request.outputs:
            where = placement(output.parameters, "output")
            if where is not None:
                targets[output.name] = where
        with contextlib.ExitStack() as held:
            for where in targets.values():
                held.enter_context(self.regions.using(caller, where.region, write=True))
            yield targets

    def write_outputs(
        self,
        outputs: tuple[OutputTensor, ...],
        targets: dict[str, Placement],
        caller: Caller | None,
    ) -> tuple[OutputTensor, ...]:
        """Write the outputs that go to regions; the response carries them as empty raw
        contents (tritonclient reads raw_output_contents by position)."""
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


def placement(parameters: Mapping[str, Any], what: str) -> Placement | None:
    """A tensor's shared-memory parameters (None: it names no region)."""
    if REGION not in parameters:
        return None
    region = parameters[REGION]
    if region.WhichOneof("parameter_choice") != "string_param":
        raise errors.invalid(f"{what} parameter {REGION} must be a string")
    numbers = []
    for key, required in ((BYTE_SIZE, True), (OFFSET, False)):
        if key not in parameters:
            if required:
                raise errors.invalid(f"{what} parameter {REGION} needs {BYTE_SIZE}")
            numbers.append(0)
            continue
        given = parameters[key]
        kind = given.WhichOneof("parameter_choice")
        if kind not in ("int64_param", "uint64_param") or getattr(given, kind) < 0:
            raise errors.invalid(f"{what} parameter {key} must be a non-negative integer")
        numbers.append(int(getattr(given, kind)))
    return Placement(region.string_param, numbers[0], numbers[1])


def _bytes_to_read(
    tensor: pb.ModelInferRequest.InferInputTensor, where: Placement, max_bytes: int
) -> int:
    """The bytes of an input to read from its region, refused beyond `max_bytes` before
    anything is read: a BYTES tensor's are its byte size (its elements' lengths are in the
    region), a numeric one's are what its shape and datatype declare, which its byte size
    must equal."""
    datatype = BY_NAME.get(tensor.datatype)
    if datatype is None:
        raise errors.invalid(
            f"input '{errors.echoed(tensor.name)}': unknown datatype "
            f"'{errors.echoed(tensor.datatype)}'"
        )
    if datatype.name == "BYTES":
        if where.byte_size > max_bytes:
            raise _too_large(tensor, max_bytes)
        return where.byte_size
    size = _declared_bytes(tensor, datatype.numpy.itemsize, max_bytes)
    if where.byte_size != size:
        raise errors.invalid(
            f"input '{errors.echoed(tensor.name)}' declares {size} bytes, its "
            f"{BYTE_SIZE} is {where.byte_size}"
        )
    return size


def _declared_bytes(
    tensor: pb.ModelInferRequest.InferInputTensor, itemsize: int, max_bytes: int
) -> int:
    """The bytes a numeric input's shape declares, refused beyond `max_bytes` as soon as the
    product passes it."""
    if any(d < 0 for d in tensor.shape):
        raise errors.invalid(f"input '{errors.echoed(tensor.name)}' has a negative dimension")
    size = itemsize
    for dim in tensor.shape:
        size *= dim
        if size > max_bytes:
            raise _too_large(tensor, max_bytes)
    return math.prod(tensor.shape) * itemsize


def _too_large(
    tensor: pb.ModelInferRequest.InferInputTensor, max_bytes: int
) -> errors.ServiceError:
    return errors.ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"input '{errors.echoed(tensor.name)}' declares more than {max_bytes} bytes in shared "
        "memory (--max-message-bytes)",
    )


def local_peer(peer: str) -> bool:
    """Whether a gRPC peer string is a loopback address: 127.0.0.0/8, ::1, or an IPv4
    loopback address mapped into IPv6 (an IPv4 caller of a dual-stack listener)."""
    socket = peer_socket(peer)
    return socket is not None and canonical(socket[0]).is_loopback


def _one_address(host: str, port: int) -> tuple[Address, int] | None:
    """The listener's address and port when it is bound to one address (not a wildcard, not
    a name) on a port given in advance."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return None if address.is_unspecified or not port else (address, port)


def _label(datagram: bool) -> str:
    return "UDP (HTTP/3)" if datagram else "TCP (HTTP/2)"


def _groups(uid: int) -> frozenset[int]:
    """The groups of `uid` in the user database, which a process of that user has from its
    login; none for a uid the database does not know (then only owner and others' bits
    count)."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return frozenset()
    return frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))
