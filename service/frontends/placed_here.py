"""A ModelInfer call whose tensors name system shared-memory regions, served by the front-end
that holds copies of them (region_copies.py): its caller known by the uid that owns its
socket, its inputs read from the regions, its outputs' regions held until the answer is
written into them, by the parent's own code (service/api/shared_memory.py). Anything this
process cannot do for the call (no copy of a region, a caller it cannot tell, the restricted
category's header missing, a bad placement) passes the call on whole, before anything of it
ran: the parent answers it in its own words, and records it."""

from __future__ import annotations

import contextlib
from typing import Any

from protos.inference import grpc_service_pb2 as pb
from service.api.shared_memory import GrpcSharedMemory
from service.dataplane.shared_memory import BYTE_SIZE, OFFSET, REGION, Placement
from service.inference.jobs import OutputTensor
from service.inference.shared_memory import Caller

# A tensor's parameters that place it in a region.
PLACEMENT_PARAMETERS = frozenset((REGION, BYTE_SIZE, OFFSET))


class PlacedTensors:
    """One call's tensors in regions; closed when its answer is written (or it ends)."""

    def __init__(self, shared: GrpcSharedMemory, context: Any, max_message: int) -> None:
        """`max_message`: the most one input may take from a region (--max-message-bytes)."""
        self._shared = shared
        self._context = context
        self._max_message = max_message
        self._caller: Caller | None = None
        self._targets: dict[str, Placement] = {}
        self._held: contextlib.ExitStack | None = None  # made once a call names regions

    @property
    def named(self) -> bool:
        """Whether the call's tensors name regions (read has run)."""
        return self._caller is not None

    async def read(self, request: pb.ModelInferRequest) -> list[bytes] | None:
        """Every input's bytes (those in regions read from them), its output regions held;
        ServiceError: the parent's to answer."""
        self._caller = await self._shared.tensor_caller(request, self._context)
        raw = self._shared.read_inputs(request, self._caller, self._max_message)
        self._held = contextlib.ExitStack()
        self._targets = self._held.enter_context(self._shared.output_targets(request, self._caller))
        return raw

    def written(self, outputs: tuple[OutputTensor, ...]) -> tuple[OutputTensor, ...]:
        """The outputs that go to regions written there; those come back with no data."""
        return self._shared.write_outputs(outputs, self._targets, self._caller)

    def close(self) -> None:
        if self._held is not None:
            self._held.close()
