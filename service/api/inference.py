"""inference.GRPCInferenceService: the Open Inference Protocol. One servicer object serves
every transport, so it only speaks in terms of a grpc.aio-style servicer context."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import metadata

import grpc

from oip.datatypes import BY_CONFIG_TYPE
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from service.inference import errors
from service.inference.errors import ServicerContext
from service.inference.jobs import InferJob, OutputTensor
from service.inference.validation import decoded
from service.lifecycle.lifecycle import Lifecycle
from service.model.decoupled import is_decoupled
from service.registry.versions import ModelRegistry, ServedVersion
from service.serving.requests import RequestRunner

log = logging.getLogger("paddlequic.api")

SERVER_NAME = "paddlequic"
# The installed distribution's version (set from clients.__version__ at build time): the server
# never imports the client package.
SERVER_VERSION = metadata.version("paddlequic")
EXTENSIONS = ("model_configuration", "model_repository", "statistics", "binary_tensor_data")
STREAM_WINDOW = 64  # requests of one stream in flight at once; more wait (backpressure)
# Triton's parameters of a decoupled model's responses (src/grpc/stream_infer_handler.cc).
FINAL_RESPONSE = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        models: ModelRegistry,
        runner: RequestRunner,
        lifecycle: Lifecycle,
        control_mode: str,
    ) -> None:
        self.models = models
        self.runner = runner
        self.lifecycle = lifecycle
        self.control_mode = control_mode

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.models.all_ready)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: ServicerContext
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS
        )

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: ServicerContext
    ) -> pb.ModelReadyResponse:
        try:
            served = self.models.resolve(request.name, request.version)
        except errors.ServiceError as exc:
            if exc.code is grpc.StatusCode.INVALID_ARGUMENT:
                await errors.abort(context, exc)
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=served.ready)

    @errors.reports_errors
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: ServicerContext
    ) -> pb.ModelMetadataResponse:
        served = self.models.resolve(request.name, request.version)
        config = served.config
        batch = [-1] if config.max_batch_size > 0 else []
        return pb.ModelMetadataResponse(
            name=served.name,
            versions=[str(v.version) for v in self.models.versions_of(served.name)],
            platform=config.platform,
            inputs=[
                pb.ModelMetadataResponse.TensorMetadata(
                    name=t.name,
                    datatype=BY_CONFIG_TYPE[t.data_type].name,
                    shape=batch + list(t.dims),
                )
                for t in config.input
            ],
            outputs=[
                pb.ModelMetadataResponse.TensorMetadata(
                    name=t.name,
                    datatype=BY_CONFIG_TYPE[t.data_type].name,
                    shape=batch + list(t.dims),
                )
                for t in config.output
            ],
        )

    @errors.reports_errors
    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: ServicerContext
    ) -> pb.ModelConfigResponse:
        served = self.models.resolve(request.name, request.version)
        return pb.ModelConfigResponse(config=served.config)

    @errors.reports_errors
    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: ServicerContext
    ) -> pb.ModelStatisticsResponse:
        if request.name:
            chosen = (
                [self.models.resolve(request.name, request.version)]
                if request.version
                else self.models.versions_of(request.name)
            )
            if not chosen:
                raise errors.not_found(f"unknown model '{request.name}'")
        else:
            chosen = self.models.all_versions()
        return pb.ModelStatisticsResponse(
            model_stats=[v.stats.to_proto(v.name, v.version) for v in chosen]
        )

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: ServicerContext
    ) -> pb.RepositoryIndexResponse:
        entries = self.models.index()
        if request.ready:
            entries = [e for e in entries if e.state == "READY"]
        return pb.RepositoryIndexResponse(models=entries)

    @errors.reports_errors
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: ServicerContext
    ) -> pb.RepositoryModelLoadResponse:
        """Load or reload; answers once the new versions serve (or why they do not)."""
        self._check_explicit_control()
        await self.lifecycle.load_model(request.model_name)
        return pb.RepositoryModelLoadResponse()

    @errors.reports_errors
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: ServicerContext
    ) -> pb.RepositoryModelUnloadResponse:
        self._check_explicit_control()
        await self.lifecycle.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    def _check_explicit_control(self) -> None:
        if self.control_mode != "explicit":
            raise errors.ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"explicit model load / unload is not allowed in model control mode "
                f"'{self.control_mode}'; start the server with --model-control-mode explicit",
            )

    @errors.reports_errors
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: ServicerContext
    ) -> pb.ModelInferResponse:
        return await self._infer(request, _deadline(context))

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
        being read: the request iterator waits for a slot, and the response queue never
        holds more than the window. A decoupled request takes its next response from its
        model only once the queue has room for it, so its model is held too."""
        # (response or None: nothing to send, whether it was the request's last)
        responses: asyncio.Queue[tuple[pb.ModelStreamInferResponse | None, bool] | None] = (
            asyncio.Queue(STREAM_WINDOW + 1)
        )
        window = asyncio.Semaphore(STREAM_WINDOW)
        tasks: set[asyncio.Task[None]] = set()
        deadline = _deadline(context)

        async def run_one(request: pb.ModelInferRequest) -> None:
            try:
                served = self.models.resolve(request.model_name, request.model_version)
                if is_decoupled(served.config):
                    await self._generate(served, request, deadline, responses.put)
                    return
                response = pb.ModelStreamInferResponse(
                    infer_response=await self._infer(request, deadline)
                )
            except errors.ServiceError as exc:
                response = _error_response(request, f"{exc.code.name}: {exc.message}")
                if served_decoupled(self.models, request):
                    _mark_final(response, True)
            await responses.put((response, True))

        async def read_requests() -> None:
            try:
                while True:
                    await window.acquire()
                    request = await anext(request_iterator, None)
                    if request is None:
                        break
                    task = asyncio.create_task(run_one(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*list(tasks))
            finally:
                await responses.put(None)

        reader = asyncio.create_task(read_requests())
        try:
            while (item := await responses.get()) is not None:
                response, last = item
                if response is not None:
                    yield response
                if last:
                    window.release()
            await reader
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _generate(
        self,
        served: ServedVersion,
        request: pb.ModelInferRequest,
        deadline: float | None,
        put: Callable[[tuple[pb.ModelStreamInferResponse | None, bool]], Awaitable[None]],
    ) -> None:
        """A decoupled model's responses to one request, put as they come; the last one put
        is final. A ServiceError before or between them ends the request (the caller turns
        it into the request's final error_message)."""
        empty_final = _empty_final_wanted(request)
        job = await _decode(served, request)
        stream = self.runner.stream(served, job, request.id, _parameters(request), deadline)
        async with contextlib.aclosing(stream) as answers:
            async for answer in answers:
                response: pb.ModelStreamInferResponse | None
                if answer.error is not None:
                    response = _error_response(
                        request, f"INTERNAL: model '{served.name}': {answer.error}"
                    )
                elif answer.outputs or not answer.final:
                    response = pb.ModelStreamInferResponse(
                        infer_response=_response(served, request.id, answer.outputs)
                    )
                elif empty_final:
                    response = pb.ModelStreamInferResponse(
                        infer_response=pb.ModelInferResponse(
                            model_name=request.model_name,
                            model_version=request.model_version,
                            id=request.id,
                        )
                    )
                else:  # a flags-only final nobody asked to see: the request just ends
                    response = None
                if response is not None:
                    _mark_final(response, answer.final)
                await put((response, answer.final))

    async def _infer(
        self, request: pb.ModelInferRequest, deadline: float | None
    ) -> pb.ModelInferResponse:
        served = self.models.resolve(request.model_name, request.model_version)
        job = await _decode(served, request)
        answered, result = await self.runner.infer(served, job, deadline)
        with self.runner.encode_span():
            response = _response(answered, request.id, result.outputs)
        if answered is not served:
            # Answered by the fallback model while `served` is open-circuited.
            response.parameters["fallback"].bool_param = True
        return response


async def _decode(served: ServedVersion, request: pb.ModelInferRequest) -> InferJob:
    """The request as a job for `served` (decoded in a thread when its shapes declare much
    per-element work); a refused request counts as one of its failures."""
    started = time.perf_counter_ns()
    try:
        assert served.validator is not None
        return await decoded(served.validator.admit(request))
    except errors.ServiceError:
        served.stats.record_failure(time.perf_counter_ns() - started)
        raise


def _response(
    served: ServedVersion, request_id: str, outputs: tuple[OutputTensor, ...]
) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(
        model_name=served.name, model_version=str(served.version), id=request_id
    )
    for tensor in outputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype.name, shape=tensor.shape)
        response.raw_output_contents.append(tensor.data)
    return response


def _error_response(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(
        error_message=message,
        infer_response=pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        ),
    )


def _mark_final(response: pb.ModelStreamInferResponse, final: bool) -> None:
    response.infer_response.parameters[FINAL_RESPONSE].bool_param = final


def served_decoupled(models: ModelRegistry, request: pb.ModelInferRequest) -> bool:
    """Whether the request names a decoupled model (its error is then its final response)."""
    try:
        return is_decoupled(models.resolve(request.model_name, request.model_version).config)
    except errors.ServiceError:
        return False


def _empty_final_wanted(request: pb.ModelInferRequest) -> bool:
    """Triton's request parameter: a flags-only final response is sent (empty) instead of
    ending the request silently."""
    parameter = request.parameters.get(EMPTY_FINAL)
    if parameter is None:
        return False
    if parameter.WhichOneof("parameter_choice") != "bool_param":
        raise errors.invalid(
            f"invalid value type for '{EMPTY_FINAL}' parameter, expected bool_param."
        )
    return parameter.bool_param


def _parameters(request: pb.ModelInferRequest) -> str:
    """The request's parameters as JSON, as pb_utils' request.parameters() returns them."""
    values = {}
    for key, parameter in request.parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        if kind is not None:
            values[key] = getattr(parameter, kind)
    return json.dumps(values)


def _deadline(context: ServicerContext) -> float | None:
    remaining = context.time_remaining()
    if remaining is None:
        return None
    return asyncio.get_running_loop().time() + remaining
