"""An ensemble on a real server: two independent Paddle steps behind one request, its
metadata, readiness, index entry and statistics, and a failing step named in the error."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
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
    rng = np.random.default_rng(7)
    features = rng.standard_normal((2, 256), dtype=np.float32)
    ids = rng.integers(0, 1000, (2, 5), dtype=np.int64)
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

        response = stub.ModelInfer(
            build_request("pair", {"features": features, "ids": ids}), timeout=TIMEOUT_S
        )
        assert response.model_name == "pair"
        got = parse_response(response)
        mlp = parse_response(
            stub.ModelInfer(build_request("mlp", {"input": features}), timeout=TIMEOUT_S)
        )
        text = parse_response(
            stub.ModelInfer(build_request("text_classifier", {"token_ids": ids}), timeout=TIMEOUT_S)
        )
        np.testing.assert_allclose(got["probs"], mlp["probabilities"], rtol=1e-5)
        np.testing.assert_allclose(got["logits"], text["logits"], rtol=1e-5)

        only = stub.ModelInfer(
            build_request("pair", {"features": features, "ids": ids}, outputs=["logits"]),
            timeout=TIMEOUT_S,
        )
        assert [t.name for t in only.outputs] == ["logits"]

        with pytest.raises(grpc.RpcError) as failed:
            stub.ModelInfer(
                build_request("pair", {"features": features, "ids": ids * 0 + 10**9}),
                timeout=TIMEOUT_S,
            )
        assert "ensemble 'pair' step 2 (model 'text_classifier') failed" in (
            failed.value.details() or ""
        )

        stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name="pair"), timeout=5)
        (pair_stats,) = stats.model_stats
        assert pair_stats.inference_stats.success.count == 2
        assert pair_stats.inference_stats.fail.count == 1
