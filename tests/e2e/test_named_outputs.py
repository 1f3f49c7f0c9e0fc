"""config.pbtxt names a Paddle program's outputs: callers see only those names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from tests.reference import example_inputs, run_reference
from tests.servers import EXAMPLE_MODELS, ServerProcess, running_server

NAMED = """
max_batch_size: 64
output [
  { name: "embedding", data_type: TYPE_FP32, dims: [ 16 ] },
  { name: "similarity", data_type: TYPE_FP32, dims: [ 1 ] }
]
"""
# One name for a program with two outputs: refused at load, with the reason.
TOO_FEW = """
max_batch_size: 64
output [ { name: "similarity", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""


def two_tower_as(root: Path, name: str, config: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    (root / name / "1").symlink_to(EXAMPLE_MODELS / "two_tower" / "1")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("named")
    two_tower_as(root / "models", "named", NAMED)
    two_tower_as(root / "models", "too_few", TOO_FEW)
    with running_server(root / "models", root / "server.log", wait=False) as process:
        process.wait_loaded()
        yield process


def test_metadata_and_responses_use_the_configured_names(server: ServerProcess) -> None:
    metadata = server.stub.ModelMetadata(pb.ModelMetadataRequest(name="named"), timeout=30)
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        ("embedding", "FP32", [-1, 16]),
        ("similarity", "FP32", [-1, 1]),
    ]
    inputs = example_inputs("two_tower")
    served = parse_response(server.stub.ModelInfer(build_request("named", inputs), timeout=30))
    assert list(served) == ["embedding", "similarity"]
    expected = list(run_reference("two_tower", inputs).values())  # in the program's order
    for array, want in zip(served.values(), expected, strict=True):
        np.testing.assert_allclose(array, want, rtol=1e-4, atol=1e-5)


def test_requested_outputs_are_the_configured_names(server: ServerProcess) -> None:
    inputs = example_inputs("two_tower")
    request = build_request("named", inputs, outputs=["similarity"])
    served = parse_response(server.stub.ModelInfer(request, timeout=30))
    assert list(served) == ["similarity"]
    np.testing.assert_allclose(
        served["similarity"], list(run_reference("two_tower", inputs).values())[1], rtol=1e-4
    )
    with pytest.raises(grpc.RpcError) as info:
        server.stub.ModelInfer(build_request("named", inputs, outputs=["fetch_name_1"]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "['embedding', 'similarity']" in (info.value.details() or "")
    stats = server.stub.ModelStatistics(pb.ModelStatisticsRequest(name="named"), timeout=30)
    assert stats.model_stats[0].inference_count >= 2 * len(inputs["user"])


def test_a_config_that_does_not_fit_the_program_fails_at_load(server: ServerProcess) -> None:
    index = server.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30).models
    (entry,) = [m for m in index if m.name == "too_few"]
    assert entry.state == "UNAVAILABLE"
    assert "lists 1 output(s) ['similarity'] but the model has 2" in entry.reason
    assert {m.name: m.state for m in index}["named"] == "READY"
