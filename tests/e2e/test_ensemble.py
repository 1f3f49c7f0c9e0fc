"""An ensemble on a real server: two independent Paddle steps behind one request, its
metadata, readiness, index entry and statistics, and a failing step named in the error; an
ensemble whose steps are ensembles, and step cycles refused at load. Its answers are compared
with its steps composed in-process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import text_format

from clients.inference_client import build_request, parse_response
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
NESTED = """
name: "nested"
platform: "ensemble"
max_batch_size: 8
input [
  { name: "f", data_type: TYPE_FP32, dims: [ 256 ] },
  { name: "i", data_type: TYPE_INT64, dims: [ -1 ] }
]
output [
  { name: "p", data_type: TYPE_FP32, dims: [ 10 ] },
  { name: "l", data_type: TYPE_FP32, dims: [ 4 ] }
]
ensemble_scheduling {
  step [
    { model_name: "pair" model_version: -1
      input_map [ { key: "features" value: "f" }, { key: "ids" value: "i" } ]
      output_map [ { key: "probs" value: "p" }, { key: "logits" value: "l" } ] }
  ]
}
"""
# Three deep (deeper -> nested -> pair -> the models), beside a step on mlp itself.
DEEPER = """
name: "deeper"
platform: "ensemble"
max_batch_size: 8
input [
  { name: "features", data_type: TYPE_FP32, dims: [ 256 ] },
  { name: "ids", data_type: TYPE_INT64, dims: [ -1 ] }
]
output [
  { name: "probs", data_type: TYPE_FP32, dims: [ 10 ] },
  { name: "logits", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "direct", data_type: TYPE_FP32, dims: [ 10 ] }
]
ensemble_scheduling {
  step [
    { model_name: "nested" model_version: -1
      input_map [ { key: "f" value: "features" }, { key: "i" value: "ids" } ]
      output_map [ { key: "p" value: "probs" }, { key: "l" value: "logits" } ] },
    { model_name: "mlp" model_version: -1
      input_map { key: "input" value: "features" }
      output_map { key: "probabilities" value: "direct" } }
  ]
}
"""
TIMEOUT_S = 60.0


def relay(name: str, step_model: str) -> str:
    """An ensemble of one step on `step_model`, which takes and gives what it does."""
    return f"""
name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "features", data_type: TYPE_FP32, dims: [ 256 ] }} ]
output [ {{ name: "probs", data_type: TYPE_FP32, dims: [ 10 ] }} ]
ensemble_scheduling {{ step [ {{ model_name: "{step_model}" model_version: -1
  input_map {{ key: "features" value: "features" }}
  output_map {{ key: "probs" value: "probs" }} }} ] }}
"""


# name -> the model its one step names: cycles of one, two and three ensembles, and an
# ensemble that names a cycle without being on it.
RELAYS = {
    "self": "self",
    "ring_a": "ring_b",
    "ring_b": "ring_a",
    "tri_a": "tri_b",
    "tri_b": "tri_c",
    "tri_c": "tri_a",
    "to_ring": "ring_a",
}
CYCLES = {
    "self": "self -> self",
    "ring_a": "ring_a -> ring_b -> ring_a",
    "ring_b": "ring_b -> ring_a -> ring_b",
    "tri_a": "tri_a -> tri_b -> tri_c -> tri_a",
    "tri_b": "tri_b -> tri_c -> tri_a -> tri_b",
    "tri_c": "tri_c -> tri_a -> tri_b -> tri_c",
}


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


def test_ensembles_nest_and_step_cycles_are_refused_with_their_path(tmp_path: Path) -> None:
    repository = model_repository(tmp_path / "models", ["mlp", "text_classifier"])
    configs = {"pair": PAIR, "nested": NESTED, "deeper": DEEPER}
    configs |= {name: relay(name, step) for name, step in RELAYS.items()}
    for name, text in configs.items():
        (repository / name).mkdir()
        (repository / name / "config.pbtxt").write_text(text)
    parsed = {name: text_format.Parse(configs[name], mc.ModelConfig()) for name in configs}
    features = call_inputs("mlp", 0)["input"]
    inputs = {"features": features, "ids": call_inputs("text_classifier", 0)["token_ids"]}

    with running_server(repository, tmp_path / "server.log", wait=False) as server:
        server.wait_loaded()
        stub = server.stub
        index = {
            m.name: (m.state, m.reason)
            for m in stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=5).models
        }
        for name, path in CYCLES.items():
            state, reason = index[name]
            assert state == "UNAVAILABLE" and f"ensemble step cycle: {path}" in reason, name
        for name in ("mlp", "text_classifier", "pair", "nested", "deeper"):
            assert index[name][0] == "READY", name
            assert stub.ModelReady(pb.ModelReadyRequest(name=name), timeout=5).ready, name

        response = stub.ModelInfer(build_request("deeper", inputs), timeout=TIMEOUT_S)
        expected = run_ensemble_reference(parsed["deeper"], inputs, parsed)
        assert_outputs(expected, response)
        served = parse_response(response)  # mlp's answer, nested or not
        np.testing.assert_allclose(served["direct"], served["probs"], rtol=1e-4, atol=1e-5)
        nested = stub.ModelInfer(
            build_request("nested", {"f": inputs["features"], "i": inputs["ids"]}),
            timeout=TIMEOUT_S,
        )
        assert_outputs({"p": expected["probs"], "l": expected["logits"]}, nested)

        # Naming a cycle only keeps an ensemble from being ready; its requests say why.
        assert not stub.ModelReady(pb.ModelReadyRequest(name="to_ring"), timeout=5).ready
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(build_request("to_ring", {"features": features}), timeout=TIMEOUT_S)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "ensemble step cycle: ring_a -> ring_b -> ring_a" in (refused.value.details() or "")
