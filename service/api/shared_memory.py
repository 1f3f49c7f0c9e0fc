"""Triton's system shared-memory extension on gRPC (service/dataplane/shared_memory.py says
who may use it and how): the three RPCs, the CUDA ones answered as Triton without a GPU answers
them, and the tensor parameters (`shared_memory_region`, `shared_memory_byte_size`,
`shared_memory_offset`) that make an input read from a registered region and an output
written into one. A request whose tensors name a region passes the `shared-memory`
restricted-protocol category, if restricted, as its RPCs do."""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

import grpc

from protos.inference import grpc_service_pb2 as pb
from service.api.callers import peer_socket
from service.api.restricted import Restriction
from service.dataplane.shared_memory import (
    BYTE_SIZE,
    OFFSET,
    REGION,
    Peer,
    Placement,
    SharedMemory,
)
from service.inference import errors
from service.inference.errors import ServicerContext
from service.inference.jobs import OutputTensor
from service.inference.shared_memory import Caller
from service.inference.socket_owners import Address


class GrpcSharedMemory:
    """The server's shared memory as gRPC's calls use it."""

    def __init__(
        self,
        shared: SharedMemory,
        restriction: Restriction | None = None,
        listener: tuple[str, int] = ("0.0.0.0", 0),
    ) -> None:
        """`listener`: the HTTP/2 listener's host and port; bound to one address (and a port
        given), a caller's socket is found by one exact lookup; on a wildcard address, first by
        the lookup of a connection from the caller's address to that same address."""
        self.shared = shared
        self.regions = shared.regions
        self.restriction = restriction  # the `shared-memory` category's, if restricted
        self._server = _one_address(*listener)
        self._listener_port = listener[1]

    def peer(self, context: ServicerContext) -> Peer:
        text = context.peer()
        # Our own servicer contexts say whether the call came over UDP (HTTP/3); grpc.aio's,
        # which has no such attribute, serves TCP only.
        datagram = bool(getattr(context, "datagram_peer", False))
        return Peer(
            peer_socket(text),
            text,
            "UDP (HTTP/3)" if datagram else "TCP (HTTP/2)",
            datagram,
            self._server,
            self._listener_port,
        )

    async def caller(self, context: ServicerContext) -> Caller:
        """Who calls, if it may use shared memory: the uid that owns its socket."""
        return await self.shared.caller(self.peer(context))

    def check_mode(self, context: ServicerContext) -> None:
        self.shared.check_mode(self.peer(context))

    async def tensor_caller(
        self, request: pb.ModelInferRequest, context: ServicerContext
    ) -> Caller | None:
        """The caller of a request whose tensors name regions (None: none does), once the
        `shared-memory` restricted category, if any, let it through."""
        if not names_regions(request):
            return None
        restriction = self.restriction
        if restriction is not None and not restriction.allows(context.invocation_metadata() or ()):
            raise errors.ServiceError(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{restriction.refusal} (this request's tensors name shared-memory regions)",
            )
        return await self.caller(context)

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
        self.shared.cuda_status(self.peer(context), name)
        return pb.CudaSharedMemoryStatusResponse()

    def cuda_register(self, context: ServicerContext, name: str) -> NoReturn:
        self.shared.cuda_register(self.peer(context), name)

    def read_inputs(
        self, request: pb.ModelInferRequest, caller: Caller | None, max_bytes: int
    ) -> list[bytes] | None:
        """Every input's bytes, those that name a region read from it, the others as the
        message carried them (None: no input names a region); the request is then validated
        like any other. `caller`: `tensor_caller`'s answer."""
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
            filled.append(
                self.shared.read_input(
                    caller,
                    where,
                    tensor.name,
                    tensor.datatype,
                    tensor.shape,
                    (max_bytes, "--max-message-bytes"),
                )
            )
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
        with self.shared.held(caller, targets):
            yield targets

    def write_outputs(
        self,
        outputs: tuple[OutputTensor, ...],
        targets: dict[str, Placement],
        caller: Caller | None,
    ) -> tuple[OutputTensor, ...]:
        """Write the outputs that go to regions; the response carries them as empty raw
        contents (tritonclient reads raw_output_contents by position)."""
        return self.shared.write_outputs(outputs, targets, caller)


def names_regions(request: pb.ModelInferRequest) -> bool:
    """Whether a tensor of the request lies in shared memory."""
    return any(REGION in t.parameters for t in request.inputs) or any(
        REGION in t.parameters for t in request.outputs
    )


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


def local_peer(peer: str) -> bool:
    """Whether a gRPC peer string is a loopback address."""
    return Peer(peer_socket(peer), peer, "").local


def _one_address(host: str, port: int) -> tuple[Address, int] | None:
    """The listener's address and port when it is bound to one address (not a wildcard, not
    a name) on a port given in advance."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return None if address.is_unspecified or not port else (address, port)
