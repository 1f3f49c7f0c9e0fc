"""Triton's system shared-memory extension at the protocol's edge: the three RPCs, and the
tensor parameters (`shared_memory_region`, `shared_memory_byte_size`, `shared_memory_offset`)
that make an input read from a registered region and an output written into one, so the
tensor never travels in the message.

Who may use it is `--shared-memory`: `local` (the default) serves the RPCs, and requests whose
tensors name regions, only to callers on the server's own host (a loopback peer): a region
is the memory of a process beside the server, and only such callers can have made one; `any`
also serves remote peers (a trusted network, behind the `shared-memory` restricted-protocol
category); `off` refuses them all. CUDA shared memory needs a GPU and is not served."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from oip.datatypes import BY_NAME
from protos.inference import grpc_service_pb2 as pb
from service.inference import errors
from service.inference.errors import ServicerContext
from service.inference.jobs import OutputTensor
from service.inference.shared_memory import SharedMemoryRegions

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

    def __init__(self, mode: str, regions: SharedMemoryRegions | None = None) -> None:
        self.mode = mode
        self.regions = regions or SharedMemoryRegions()

    def check_caller(self, context: ServicerContext) -> None:
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

    def status(self, name: str) -> pb.SystemSharedMemoryStatusResponse:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self.regions.status(name):
            response.regions[region.name].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(
                    name=region.name,
                    key=region.key,
                    offset=region.offset,
                    byte_size=region.byte_size,
                )
            )
        return response

    def read_inputs(
        self, request: pb.ModelInferRequest, context: ServicerContext, max_bytes: int
    ) -> list[bytes] | None:
        """Every input's bytes, those that name a region read from it, the others as the
        message carried them (None: no input names a region); the request is then validated
        like any other. The bytes read are what its shape and datatype declare, at most
        `max_bytes` (what a message may carry)."""
        placements = [placement(t.parameters, "input") for t in request.inputs]
        if not any(placements):
            return None
        self.check_caller(context)
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
            size = _declared_bytes(tensor, max_bytes)
            if where.byte_size != size:
                raise errors.invalid(
                    f"input '{errors.echoed(tensor.name)}' declares {size} bytes, its "
                    f"{BYTE_SIZE} is {where.byte_size}"
                )
            with self.regions.using(where.region) as region:
                filled.append(region.read(where.offset, size))
        return filled

    @contextlib.contextmanager
    def output_targets(
        self, request: pb.ModelInferRequest, context: ServicerContext
    ) -> Iterator[dict[str, Placement]]:
        """The outputs the request wants written into regions, by name; the regions stay held
        (their descriptors open) until the response is built."""
        targets = {}
        for output in request.outputs:
            where = placement(output.parameters, "output")
            if where is not None:
                targets[output.name] = where
        if not targets:
            yield targets
            return
        self.check_caller(context)
        with contextlib.ExitStack() as held:
            for where in targets.values():
                held.enter_context(self.regions.using(where.region))
            yield targets

    def write_outputs(
        self, outputs: tuple[OutputTensor, ...], targets: dict[str, Placement]
    ) -> tuple[OutputTensor, ...]:
        """Write the outputs that go to regions; the response carries them as empty raw
        contents (tritonclient reads raw_output_contents by position)."""
        if not targets:
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
            with self.regions.using(where.region) as region:
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


def _declared_bytes(tensor: pb.ModelInferRequest.InferInputTensor, max_bytes: int) -> int:
    """The bytes an input's shape and datatype declare, refused beyond `max_bytes` before
    anything is read."""
    datatype = BY_NAME.get(tensor.datatype)
    if datatype is None or datatype.name == "BYTES":
        raise errors.invalid(
            f"input '{errors.echoed(tensor.name)}': datatype "
            f"'{errors.echoed(tensor.datatype)}' cannot be read from shared memory here "
            "(numeric datatypes only)"
        )
    if any(d < 0 for d in tensor.shape):
        raise errors.invalid(f"input '{errors.echoed(tensor.name)}' has a negative dimension")
    size = datatype.numpy.itemsize
    for dim in tensor.shape:
        size *= dim
        if size > max_bytes:
            raise errors.ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"input '{errors.echoed(tensor.name)}' declares more than {max_bytes} bytes "
                "(--max-message-bytes)",
            )
    return math.prod(tensor.shape) * datatype.numpy.itemsize


def local_peer(peer: str) -> bool:
    """Whether a gRPC peer string (`ipv4:HOST:PORT`, `ipv6:[HOST]:PORT`, `unix:...`) is on
    this host."""
    kind, _, address = peer.partition(":")
    if kind == "unix":
        return True
    if kind == "ipv6":
        host = address.rpartition("]")[0].lstrip("[")
    elif kind == "ipv4":
        host = address.rpartition(":")[0]
    else:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
