"""An ensemble on a real server: two independent Paddle steps behind one request, its
metadata, readiness, index entry and statistics, and a failing step named in the error. Its
answers are compared with its steps composed in-process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import text_format

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from tests.reference import assert_outputs, call_inputs, run_ensemble_reference
from tests.servers import model_repository, running_server

PAIR = """
name: "pair"
platform: "ensemble"
max_batch_size: 8
input [
  { name: "features", data_type: TYPE_FP32, dims: [ 256 ] },
  { name: "ids", data_type: TYPE_INT64, dims: [ -1 ] }
]
output [
  { name: "probs", data_type: TYPE_FP32, dims: [ 10 ] },
  { name: "logits", data_type: TYPE_FP32, dims: [ 4 ] }
]
ensemble_scheduling {
  step [
    { model_name: "mlp" model_version: -1
      input_map { key: "input" value: "features" }
      output_map { key: "probabilities" value: "probs" } },
    { model_name: "text_classifier" model_version: 1
      input_map { key: "token_ids" value: "ids" }
      output_map { key: "logits" value: "logits" } }
  ]
}
"""
TIMEOUT_S = 60.0


def test_ensemble_runs_its_steps_and_reports_like_a_model(tmp_path: Path) -> None:
    repository = model_repository(tmp_path / "models", ["mlp", "text_classifier"])
    (repository / "pair").mkdir()
    (repository / "pair" / "config.pbtxt").write_text(PAIR)
    config = text_format.Parse(PAIR, mc.ModelConfig())

    def pair_inputs(call: int) -> dict[str, np.ndarray[Any, Any]]:
        return {
            "features": call_inputs("mlp", call)["input"],
            "ids": call_inputs("text_classifier", call)["token_ids"][:, :5],
        }

    with running_server(repository, tmp_path / "server.log") as server:
        stub = server.stub
        assert stub.ModelReady(pb.ModelReadyRequest(name="pair"), timeout=5).ready
        metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name="pair"), timeout=5)
        assert metadata.platform == "ensemble"
        assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
            ("features", "FP32", [-1, 256]),
            ("ids", "INT64", [-1, -1]),
        ]
        index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=5).models
        assert ("pair", "READY") in [(m.name, m.state) for m in index]

        for call in range(2):
            inputs = pair_inputs(call)
            response = stub.ModelInfer(build_request("pair", inputs), timeout=TIMEOUT_S)
            assert response.model_name == "pair"
            assert_outputs(run_ensemble_reference(config, inputs), response)

        inputs = pair_inputs(2)
        only = stub.ModelInfer(build_request("pair", inputs, outputs=["logits"]), timeout=TIMEOUT_S)
        expected = run_ensemble_reference(config, inputs)
        assert_outputs({"logits": expected["logits"]}, only)

        with pytest.raises(grpc.RpcError) as failed:
            stub.ModelInfer(
                build_request("pair", {**inputs, "ids": inputs["ids"] * 0 + 10**9}),
                timeout=TIMEOUT_S,
            )
        assert "ensemble 'pair' step 2 (model 'text_classifier') failed" in (
            failed.value.details() or ""
        )

        stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name="pair"), timeout=5)
        (pair_stats,) = stats.model_stats
        assert pair_stats.inference_stats.success.count == 3
        assert pair_stats.inference_stats.fail.count == 1
