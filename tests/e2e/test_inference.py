"""ModelInfer and ModelStreamInfer against the real server, compared with in-process Paddle."""

from __future__ import annotations

import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from tests.reference import (
    EXAMPLES,
    assert_matches_reference,
    example_inputs,
    output_names,
    run_reference,
)
from tests.servers import ServerProcess


@pytest.mark.parametrize("model", EXAMPLES)
def test_model_infer_matches_in_process_paddle(server: ServerProcess, model: str) -> None:
    inputs = example_inputs(model)
    response = server.stub.ModelInfer(build_request(model, inputs, request_id="r1"), timeout=60)
    assert (response.model_name, response.model_version, response.id) == (model, "1", "r1")
    assert_matches_reference(model, inputs, response)


def test_requested_output_subset(server: ServerProcess) -> None:
    inputs = example_inputs("two_tower")
    score = output_names("two_tower")[1]
    request = build_request("two_tower", inputs, outputs=[score])
    served = parse_response(server.stub.ModelInfer(request, timeout=30))
    assert list(served) == [score]
    expected = run_reference("two_tower", inputs)[score]
    np.testing.assert_allclose(served[score], expected, rtol=1e-4, atol=1e-5)


def test_typed_contents_equal_raw(server: ServerProcess) -> None:
    array = example_inputs("mlp")["input"]
    typed = pb.ModelInferRequest(model_name="mlp")
    tensor = typed.inputs.add(name="input", datatype="FP32", shape=array.shape)
    tensor.contents.fp32_contents.extend(array.ravel().tolist())
    raw = build_request("mlp", {"input": array})
    output = output_names("mlp")[0]
    assert parse_response(server.stub.ModelInfer(typed, timeout=30))[output].tobytes() == (
        parse_response(server.stub.ModelInfer(raw, timeout=30))[output].tobytes()
    )


def test_metadata_config_statistics_and_index(server: ServerProcess) -> None:
    metadata = server.stub.ModelMetadata(pb.ModelMetadataRequest(name="text_classifier"))
    assert metadata.platform == "paddle_inference"
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("token_ids", "INT64", [-1, -1])
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        (output_names("text_classifier")[0], "FP32", [-1, 4])
    ]
    config = server.stub.ModelConfig(pb.ModelConfigRequest(name="mlp")).config
    assert (config.name, config.max_batch_size) == ("mlp", 64)
    before = server.stub.ModelStatistics(pb.ModelStatisticsRequest(name="two_tower"))
    server.stub.ModelInfer(build_request("two_tower", example_inputs("two_tower")), timeout=30)
    after = server.stub.ModelStatistics(pb.ModelStatisticsRequest(name="two_tower"))
    (b,), (a,) = before.model_stats, after.model_stats
    assert a.inference_stats.success.count == b.inference_stats.success.count + 1
    assert a.inference_count == b.inference_count + 3
    assert a.inference_stats.compute_infer.ns > b.inference_stats.compute_infer.ns
    index = server.stub.RepositoryIndex(pb.RepositoryIndexRequest())
    assert {(m.name, m.version, m.state) for m in index.models} == {
        (name, "1", "READY") for name in EXAMPLES
    }
    assert server.stub.ServerLive(pb.ServerLiveRequest()).live
    assert server.stub.ModelReady(pb.ModelReadyRequest(name="resnet18")).ready
    assert not server.stub.ModelReady(pb.ModelReadyRequest(name="nope")).ready
