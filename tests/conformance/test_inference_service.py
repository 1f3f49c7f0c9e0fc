"""GRPCInferenceService, health and server reflection over both transports."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as alpha_grpc

from clients.inference_client import build_request
from protos.grpc.reflection.v1 import reflection_pb2 as v1_pb2
from protos.grpc.reflection.v1 import reflection_pb2_grpc as v1_grpc
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.conformance.conftest import EOF, MODELS, ChannelFactory
from tests.reference import assert_matches_reference, call_inputs, example_inputs, output_names
from tests.servers import ServerProcess, gather_held

CONCURRENT_CALLS = 16


async def test_liveness_readiness_and_server_metadata(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert (await stub.ServerLive(pb.ServerLiveRequest())).live
        assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
        for model in MODELS:
            assert (await stub.ModelReady(pb.ModelReadyRequest(name=model))).ready
        assert not (await stub.ModelReady(pb.ModelReadyRequest(name="nope"))).ready
        metadata = await stub.ServerMetadata(pb.ServerMetadataRequest())
        assert metadata.name == "paddlequic"
        assert "binary_tensor_data" in metadata.extensions


async def test_errors_triton_clients_compare_start_with_tritons_texts(
    make_channel: ChannelFactory,
) -> None:
    """Unknown model, a version string that is no number, and typed contents beside
    raw_input_contents (checked before the raw contents are counted, as Triton does)."""
    async with make_channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.ModelMetadata(pb.ModelMetadataRequest(name="wrong_model_name"))
        request = build_request("mlp", example_inputs("mlp"))
        request.model_version = "wrong_specification"
        with pytest.raises(grpc.aio.AioRpcError) as version:
            await stub.ModelInfer(request)
        both = pb.ModelInferRequest(model_name="two_tower")
        for name, width in (("user", 32), ("item", 48)):
            tensor = both.inputs.add(name=name, datatype="FP32", shape=[1, width])
            tensor.contents.fp32_contents.extend([0.5] * width)
        both.raw_input_contents.append(bytes(32 * 4))
        with pytest.raises(grpc.aio.AioRpcError) as contents:
            await stub.ModelInfer(both)
    assert (unknown.value.details() or "").startswith(
        "Request for unknown model: 'wrong_model_name' is not found"
    )
    assert (version.value.details() or "").startswith(
        "failed to get model version from specified version string 'wrong_specification'"
    )
    assert contents.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (contents.value.details() or "").startswith(
        "contents field must not be specified when using raw_input_contents for 'user' for "
        "model 'two_tower'"
    )


async def test_model_metadata_config_and_index(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        metadata = await stub.ModelMetadata(pb.ModelMetadataRequest(name="two_tower"))
        assert (metadata.name, list(metadata.versions)) == ("two_tower", ["1"])
        assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
            ("user", "FP32", [-1, 32]),
            ("item", "FP32", [-1, 48]),
        ]
        assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
            (output_names("two_tower")[0], "FP32", [-1, 16]),
            (output_names("two_tower")[1], "FP32", [-1, 1]),
        ]
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="mlp"))).config
        assert (config.name, config.max_batch_size) == ("mlp", 64)
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
        assert {(m.name, m.version, m.state) for m in index.models} == {
            (name, "1", "READY") for name in MODELS
        }
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.ModelMetadata(pb.ModelMetadataRequest(name="nope"))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert (error.value.details() or "").startswith(
            "Request for unknown model: 'nope' is not found"
        )


@pytest.mark.parametrize("model", MODELS)
async def test_model_infer_matches_in_process_paddle(
    make_channel: ChannelFactory, model: str
) -> None:
    inputs = call_inputs(model, 0)
    async with make_channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = build_request(model, inputs, request_id="conformance")
        response = await stub.ModelInfer(request, timeout=60)
        assert (response.model_name, response.model_version, response.id) == (
            model,
            "1",
            "conformance",
        )
        assert_matches_reference(model, inputs, response)


async def test_concurrent_calls_on_one_channel_get_their_own_answers(
    make_channel: ChannelFactory, conformance_server: ServerProcess
) -> None:
    """Calls multiplexed on one connection, each with inputs of its own, held until all
    arrived so that they share batches: an answer given to another call fails its check."""
    inputs = [call_inputs("mlp", call) for call in range(CONCURRENT_CALLS)]
    async with make_channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelInfer(build_request("mlp", x), timeout=60) for x in inputs]
        responses = await gather_held(conformance_server, "mlp", calls)
    for x, response in zip(inputs, responses, strict=True):
        assert_matches_reference("mlp", x, response)


async def test_model_statistics_count_an_inference(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelStatisticsRequest(name="two_tower")
        (before,) = (await stub.ModelStatistics(request)).model_stats
        inputs = example_inputs("two_tower")
        await stub.ModelInfer(build_request("two_tower", inputs), timeout=60)
        (after,) = (await stub.ModelStatistics(request)).model_stats
        assert after.inference_stats.success.count == before.inference_stats.success.count + 1
        assert after.inference_count == before.inference_count + 3


async def test_stream_infer_with_a_bad_request_in_the_middle(make_channel: ChannelFactory) -> None:
    good = [call_inputs("mlp", call) for call in range(5)]
    requests = [build_request("mlp", x, request_id=f"ok-{i}") for i, x in enumerate(good)]
    bad = build_request("mlp", {"input": np.zeros((2, 255), np.float32)}, request_id="bad")
    requests.insert(2, bad)

    async def generate() -> AsyncIterator[pb.ModelInferRequest]:
        for request in requests:
            yield request

    async with make_channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer(generate(), timeout=60)
        responses = [response async for response in call]
        assert await call.code() == grpc.StatusCode.OK
        assert len(responses) == len(requests)
        by_id = {r.infer_response.id: r for r in responses}
        assert "dimension 1 must be 256" in by_id["bad"].error_message
        for i, inputs in enumerate(good):
            response = by_id[f"ok-{i}"]
            assert response.error_message == ""
            assert_matches_reference("mlp", inputs, response.infer_response)


async def test_repository_model_load_needs_explicit_control_mode(
    make_channel: ChannelFactory,
) -> None:
    """The conformance server runs in control mode none, as Triton's default: explicit loads
    are refused with the reason, identically on both transports."""

    async with make_channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mlp"))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--model-control-mode explicit" in (error.value.details() or "")


async def test_health_check(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        for service in ("", "inference.GRPCInferenceService", *MODELS):
            request = health_pb2.HealthCheckRequest(service=service)
            assert (await stub.Check(request)).status == serving
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND


EXPECTED_SERVICES = {
    "inference.GRPCInferenceService",
    "paddlequic.v1.Control",
    "paddlequic.v1.Testing",
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
}


async def test_reflection_lists_services(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        v1 = v1_grpc.ServerReflectionStub(channel)
        responses = [
            response
            async for response in v1.ServerReflectionInfo(
                iter([v1_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        ]
        assert len(responses) == 1
        names = {s.name for s in responses[0].list_services_response.service}
        assert names >= EXPECTED_SERVICES

        alpha = alpha_grpc.ServerReflectionStub(channel)
        call = alpha.ServerReflectionInfo(timeout=10)
        await call.write(alpha_pb2.ServerReflectionRequest(list_services=""))
        response = await call.read()
        names = {s.name for s in response.list_services_response.service}
        assert names >= EXPECTED_SERVICES
        await call.write(
            alpha_pb2.ServerReflectionRequest(file_containing_symbol="paddlequic.v1.Testing")
        )
        response = await call.read()
        assert response.file_descriptor_response.file_descriptor_proto
        await call.done_writing()
        assert await call.read() == EOF
        assert await call.code() == grpc.StatusCode.OK
