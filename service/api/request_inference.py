"""One ModelInferRequest run through the data plane, for ModelInfer and for each request of
ModelStreamInfer whose model is not decoupled: inputs read from the shared-memory regions its
tensors name, a sequence's request checked against whose sequence it is, outputs written to
regions, the response encoded; and the call's deadline as the data plane takes it."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

from protos.inference import grpc_service_pb2 as pb
from service.api import stream_responses
from service.api.shared_memory import GrpcSharedMemory
from service.dataplane.plane import DataPlane
from service.dataplane.sequence_callers import SequenceCallers
from service.inference import classification
from service.inference.errors import ServicerContext
from service.inference.identity import identity_of
from service.inference.jobs import InferJob
from service.registry.versions import ServedVersion


@dataclass(frozen=True)
class RequestInference:
    """ModelInferRequests inferred, each on its own."""

    plane: DataPlane
    shared_memory: GrpcSharedMemory
    max_message_bytes: int  # the most an input read from shared memory may hold
    sequence_callers: SequenceCallers

    async def infer(
        self, request: pb.ModelInferRequest, deadline: float | None, context: ServicerContext
    ) -> pb.ModelInferResponse:
        named = (request.model_name, request.model_version)
        async with self.plane.serving(*named, deadline) as served:
            return await self.infer_on(served, request, deadline, context)

    async def infer_on(
        self,
        served: ServedVersion,
        request: pb.ModelInferRequest,
        deadline: float | None,
        context: ServicerContext,
    ) -> pb.ModelInferResponse:
        """Tensors that name shared-memory regions are read from and written to them."""
        counts = classification.class_counts(request)
        shared = self.shared_memory
        caller = await shared.tensor_caller(request, context)
        raw = shared.read_inputs(request, caller, self.max_message_bytes)
        with shared.output_targets(request, caller) as targets:
            job = await decode(self.plane, served, request, raw)
            if served.sequences is not None:
                job = self.sequence_callers.owned(served.name, job, identity_of(context))
            inferred = await self.plane.infer(served, job, deadline, counts)
            answered = inferred.answered
            outputs = shared.write_outputs(inferred.outputs, targets, caller)
        with self.plane.runner.encode_span():
            response = stream_responses.infer_response(
                answered.name, str(answered.version), request.id, outputs
            )
        if inferred.fallback:
            # Answered by the fallback model while `served` is open-circuited.
            response.parameters["fallback"].bool_param = True
        return response


async def decode(
    plane: DataPlane,
    served: ServedVersion,
    request: pb.ModelInferRequest,
    raw: list[bytes] | None = None,
) -> InferJob:
    """The request as a job for `served`. `raw`: its inputs' bytes when they did not come in
    the message."""
    assert served.validator is not None
    return await plane.admitted(served, functools.partial(served.validator.admit, request, raw))


def call_deadline(context: ServicerContext) -> float | None:
    """The call's deadline on the event loop's clock (None: it has none)."""
    remaining = context.time_remaining()
    if remaining is None:
        return None
    return asyncio.get_running_loop().time() + remaining
