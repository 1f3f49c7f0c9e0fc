"""inference.GRPCInferenceService: the Open Inference Protocol. One servicer object serves
every transport, so it only speaks in terms of a grpc.aio-style servicer context."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from service.api.request_inference import RequestInference, call_deadline
from service.api.shared_memory import GrpcSharedMemory
from service.api.stream_inference import StreamInference
from service.api.stream_outbox import StreamBounds
from service.dataplane.plane import DataPlane, TensorMetadata
from service.dataplane.sequence_callers import SequenceCallers
from service.inference import errors
from service.inference.errors import ServicerContext
from service.lifecycle.uploads import FILE_PREFIX


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The protocol's messages converted to and from the data plane's calls (what REST
    routes call too), plus what only gRPC serves: streams, repository control and shared
    memory."""

    def __init__(
        self,
        plane: DataPlane,
        shared_memory: GrpcSharedMemory,
        max_message_bytes: int,
        stream_bounds: StreamBounds,
        sequence_callers: SequenceCallers,
    ) -> None:
        self.plane = plane
        self.shared_memory = shared_memory
        self.requests = RequestInference(plane, shared_memory, max_message_bytes, sequence_callers)
        self.streams = StreamInference(plane, self.requests, stream_bounds)

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.plane.ready)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: ServicerContext
    ) -> pb.ServerMetadataResponse:
        described = self.plane.server_metadata()
        return pb.ServerMetadataResponse(
            name=described.name, version=described.version, extensions=described.extensions
        )

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: ServicerContext
    ) -> pb.ModelReadyResponse:
        try:
            ready = self.plane.model_ready(request.name, request.version)
        except errors.ServiceError as exc:
            await errors.abort(context, exc)
        return pb.ModelReadyResponse(ready=ready)

    @errors.reports_errors
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: ServicerContext
    ) -> pb.ModelMetadataResponse:
        await self.plane.in_memory(request.name, call_deadline(context))
        described = self.plane.model_metadata(request.name, request.version)
        return pb.ModelMetadataResponse(
            name=described.name,
            versions=described.versions,
            platform=described.platform,
            inputs=[_tensor_metadata(t) for t in described.inputs],
            outputs=[_tensor_metadata(t) for t in described.outputs],
        )

    @errors.reports_errors
    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: ServicerContext
    ) -> pb.ModelConfigResponse:
        await self.plane.in_memory(request.name, call_deadline(context))
        return pb.ModelConfigResponse(config=self.plane.model_config(request.name, request.version))

    @errors.reports_errors
    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: ServicerContext
    ) -> pb.ModelStatisticsResponse:
        chosen = await self.plane.statistics(request.name, request.version)
        return pb.ModelStatisticsResponse(
            model_stats=[v.stats.to_proto(v.name, v.version) for v in chosen]
        )

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: ServicerContext
    ) -> pb.RepositoryIndexResponse:
        return pb.RepositoryIndexResponse(models=await self.plane.repository_index(request.ready))

    @errors.reports_errors
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: ServicerContext
    ) -> pb.RepositoryModelLoadResponse:
        """Load or reload (DataPlane.load); `file:PATH` parameters are the model's files."""
        params = request.parameters
        config = params["config"].string_param if "config" in params else None
        files = {
            key.removeprefix(FILE_PREFIX): value.bytes_param
            for key, value in params.items()
            if key.startswith(FILE_PREFIX)
        }
        await self.plane.load(request.model_name, config, files)
        return pb.RepositoryModelLoadResponse()

    @errors.reports_errors
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: ServicerContext
    ) -> pb.RepositoryModelUnloadResponse:
        await self.plane.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    @errors.reports_errors
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: ServicerContext
    ) -> pb.SystemSharedMemoryStatusResponse:
        shared = self.shared_memory
        return shared.status(await shared.caller(context), request.name)

    @errors.reports_errors
    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: ServicerContext
    ) -> pb.SystemSharedMemoryRegisterResponse:
        shared = self.shared_memory
        caller = await shared.caller(context)
        await shared.shared.register(
            caller, request.name, request.key, request.offset, request.byte_size
        )
        return pb.SystemSharedMemoryRegisterResponse()

    @errors.reports_errors
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: ServicerContext
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        shared = self.shared_memory
        await shared.shared.unregister(await shared.caller(context), request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @errors.reports_errors
    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: ServicerContext
    ) -> pb.CudaSharedMemoryStatusResponse:
        return self.shared_memory.cuda_status(context, request.name)

    @errors.reports_errors
    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: ServicerContext
    ) -> pb.CudaSharedMemoryRegisterResponse:
        self.shared_memory.cuda_register(context, request.name)

    @errors.reports_errors
    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: ServicerContext
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        """Nothing is registered, so nothing is left registered (Triton's answer)."""
        self.shared_memory.check_mode(context)
        return pb.CudaSharedMemoryUnregisterResponse()

    @errors.reports_errors
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: ServicerContext
    ) -> pb.ModelInferResponse:
        return await self.requests.infer(request, call_deadline(context), context)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: ServicerContext,
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Its requests' responses as they come (service/api/stream_inference.py)."""
        responses = self.streams.responses(request_iterator, context)
        async with contextlib.aclosing(responses) as answered:
            async for response in answered:
                yield response


def _tensor_metadata(tensor: TensorMetadata) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(
        name=tensor.name, datatype=tensor.datatype, shape=tensor.shape
    )
