"""inference.GRPCInferenceService: the Open Inference Protocol. One servicer object serves
every transport, so it only speaks in terms of a grpc.aio-style servicer context."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator

import grpc

from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from service.api import stream_responses
from service.api.callers import client_of
from service.api.shared_memory import GrpcSharedMemory
from service.api.stream_outbox import Outbox, StallWatch, StreamBounds, response_bytes
from service.dataplane.plane import DataPlane, TensorMetadata
from service.dataplane.sequence_callers import SequenceCallers
from service.inference import classification, errors
from service.inference.errors import ServicerContext
from service.inference.identity import identity_of
from service.inference.jobs import InferJob
from service.inference.validation import request_sequence
from service.lifecycle.uploads import FILE_PREFIX
from service.registry.versions import ModelRegistry, ServedVersion

log = logging.getLogger("paddlequic.api")

STREAM_WINDOW = 64  # requests of one stream in flight at once; more wait (backpressure)


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
        self.models = plane.models
        self.runner = plane.runner
        self.shared_memory = shared_memory
        self.max_message_bytes = max_message_bytes
        self.stream_bounds = stream_bounds
        self.sequence_callers = sequence_callers

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
        chosen = self.plane.statistics(request.name, request.version)
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
        shared.regions.register(
            caller, request.name, request.key, request.offset, request.byte_size
        )
        return pb.SystemSharedMemoryRegisterResponse()

    @errors.reports_errors
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: ServicerContext
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        shared = self.shared_memory
        shared.regions.unregister(await shared.caller(context), request.name)
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
        return await self._infer(request, call_deadline(context), context)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: ServicerContext,
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests run concurrently and answer in completion order (correlate by id); a
        failed request yields an error_message and the stream goes on. A decoupled model's
        request answers with zero to many responses, interleaved with the others', each
        with `triton_final_response` (true on its last).

        A request holds its slot in the window until its final response was taken by the
        transport (the generator resumes only then), so a client that stops reading stops
        being read: the request iterator waits for a slot, and the outbox never holds more
        than the window nor, but for one response, more than --stream-buffer-bytes. A
        decoupled request takes its next response from its model only once the outbox has
        room for it, so its model is held too, but not for long: a caller that takes no
        response for --stream-stall-timeout has every request of the stream cancelled
        (their places and batch slots free), and the stream ends RESOURCE_EXHAUSTED once
        the transport takes what it was sending."""
        # (response or None: nothing to send, whether it was the request's last)
        outbox: Outbox[tuple[pb.ModelStreamInferResponse | None, bool] | None] = Outbox(
            STREAM_WINDOW + 1, self.stream_bounds.buffer_bytes, response_bytes
        )
        window = asyncio.Semaphore(STREAM_WINDOW)
        tasks: set[asyncio.Task[None]] = set()
        deadline = call_deadline(context)
        client = client_of(context)

        # The last request of each sequence on this stream: the next one of it waits for it,
        # so a sequence's requests reach its batcher in the order the stream sent them.
        chains: dict[tuple[str, int | str], asyncio.Task[None]] = {}

        async def put(item: tuple[pb.ModelStreamInferResponse | None, bool]) -> None:
            await outbox.room()
            outbox.put(item)

        async def run_one(
            request: pb.ModelInferRequest, previous: asyncio.Task[None] | None
        ) -> None:
            if previous is not None:
                await asyncio.wait({previous})
            try:
                named = (request.model_name, request.model_version)
                async with self.plane.serving(*named, deadline) as served:
                    if served.decoupled:
                        await self._generate(served, request, deadline, client, outbox)
                        return
                    response = pb.ModelStreamInferResponse(
                        infer_response=await self._infer_on(served, request, deadline, context)
                    )
            except errors.ServiceError as exc:
                response = stream_responses.error(request, f"{exc.code.name}: {exc.message}")
                if _served_decoupled(self.models, request):
                    stream_responses.mark_final(response, True)
            await put((response, True))

        async def read_requests() -> None:
            try:
                while True:
                    await window.acquire()
                    request = await anext(request_iterator, None)
                    if request is None:
                        break
                    key = _sequence_key(request)
                    task = asyncio.create_task(
                        run_one(request, None if key is None else chains.get(key))
                    )
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    if key is not None:
                        chains[key] = task
                        task.add_done_callback(functools.partial(_unchain, chains, key))
                if tasks:
                    await asyncio.gather(*list(tasks))
            finally:
                outbox.put(None)

        cancelled: list[int] = []  # how many requests the stall cancelled

        def stall() -> None:
            """The caller took nothing for stall_s: its requests end now, not when it leaves."""
            cancelled.append(len(tasks))
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            outbox.clear()

        reader = asyncio.create_task(read_requests())
        watch = StallWatch(self.stream_bounds.stall_s, stall)
        try:
            while (item := await outbox.get()) is not None:
                response, last = item
                if response is not None:
                    watch.sending()
                    yield response
                    watch.sent()
                if watch.stalled:
                    break
                if last:
                    window.release()
            if watch.stalled:
                await errors.abort(context, stalled(self.stream_bounds.stall_s, cancelled[0]))
            await reader
        finally:
            watch.close()
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _generate(
        self,
        served: ServedVersion,
        request: pb.ModelInferRequest,
        deadline: float | None,
        client: str,
        outbox: Outbox[tuple[pb.ModelStreamInferResponse | None, bool] | None],
    ) -> None:
        """A decoupled model's responses to one request, put as they come; the last one put
        is final. A ServiceError before or between them ends the request (the caller turns
        it into the request's final error_message). Each response is built only once the
        outbox has room for it: a response repeats the request's id, and one built per token
        while the caller does not read would hold that id once per token."""
        empty_final = stream_responses.empty_final_wanted(request)
        counts = classification.class_counts(request)
        job = await _decode(self.plane, served, request)
        stream = self.runner.stream(
            served, job, request.id, stream_responses.parameters(request), deadline, client
        )
        async with contextlib.aclosing(stream) as answers:
            async for answer in answers:
                if counts and answer.outputs:
                    ranked = classification.classified(
                        answer.outputs, counts, served.config.max_batch_size > 0, served.labels
                    )
                    answer = dataclasses.replace(answer, outputs=ranked)
                await outbox.room()
                response = stream_responses.decoupled(
                    served.name, str(served.version), request, answer, empty_final
                )
                outbox.put((response, answer.final))

    async def _infer(
        self, request: pb.ModelInferRequest, deadline: float | None, context: ServicerContext
    ) -> pb.ModelInferResponse:
        named = (request.model_name, request.model_version)
        async with self.plane.serving(*named, deadline) as served:
            return await self._infer_on(served, request, deadline, context)

    async def _infer_on(
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
            job = await _decode(self.plane, served, request, raw)
            if served.sequences is not None:
                job = self.sequence_callers.owned(served.name, job, identity_of(context))
            inferred = await self.plane.infer(served, job, deadline, counts)
            answered = inferred.answered
            outputs = shared.write_outputs(inferred.outputs, targets, caller)
        with self.runner.encode_span():
            response = stream_responses.infer_response(
                answered.name, str(answered.version), request.id, outputs
            )
        if inferred.fallback:
            # Answered by the fallback model while `served` is open-circuited.
            response.parameters["fallback"].bool_param = True
        return response


async def _decode(
    plane: DataPlane,
    served: ServedVersion,
    request: pb.ModelInferRequest,
    raw: list[bytes] | None = None,
) -> InferJob:
    """The request as a job for `served`. `raw`: its inputs' bytes when they did not come in
    the message."""
    assert served.validator is not None
    return await plane.admitted(served, functools.partial(served.validator.admit, request, raw))


def _served_decoupled(models: ModelRegistry, request: pb.ModelInferRequest) -> bool:
    """Whether the request names a decoupled model (its error is then its final response)."""
    try:
        return models.resolve(request.model_name, request.model_version).decoupled
    except errors.ServiceError:
        return False


def _sequence_key(request: pb.ModelInferRequest) -> tuple[str, int | str] | None:
    """The sequence a stream's request belongs to (None: none, or parameters that its model
    will refuse)."""
    try:
        flags = request_sequence(request)
    except errors.ServiceError:
        return None
    return None if flags is None else (request.model_name, flags.corrid)


def _unchain(
    chains: dict[tuple[str, int | str], asyncio.Task[None]],
    key: tuple[str, int | str],
    task: asyncio.Task[None],
) -> None:
    if chains.get(key) is task:
        del chains[key]


def _tensor_metadata(tensor: TensorMetadata) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(
        name=tensor.name, datatype=tensor.datatype, shape=tensor.shape
    )


def stalled(stall_s: float, cancelled: int) -> errors.ServiceError:
    return errors.ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the caller took no response of this stream for {stall_s:g} s "
        f"(--stream-stall-timeout); its {cancelled} request(s) in flight were cancelled",
    )


def call_deadline(context: ServicerContext) -> float | None:
    """The call's deadline on the event loop's clock (None: it has none)."""
    remaining = context.time_remaining()
    if remaining is None:
        return None
    return asyncio.get_running_loop().time() + remaining
