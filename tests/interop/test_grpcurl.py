"""The real grpcurl binary against the real server: a tool that knows nothing about our protos and
learns everything through server reflection, so this is what an operator poking at a deployment
sees (reflection v1/v1alpha and health are served on every transport)."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.reference import example_inputs, output_names, run_reference
from tests.servers import ServerProcess

GRPCURL_TIMEOUT_S = 60
# grpcurl exits with 64 + the gRPC status code when a call fails.
NOT_FOUND_EXIT = 64 + 5


def _grpcurl_path() -> Path | None:
    beside = Path(sys.executable).parent / "grpcurl"
    if beside.exists():
        return beside
    found = shutil.which("grpcurl")
    return Path(found) if found else None


GRPCURL = _grpcurl_path()
pytestmark = pytest.mark.skipif(GRPCURL is None, reason="grpcurl is not installed (dev extra)")


def grpcurl(
    server: ServerProcess, *args: str, data: dict[str, Any] | None = None
) -> subprocess.CompletedProcess[str]:
    """``grpcurl -plaintext [-d JSON] ADDRESS ARGS...``; never raises on a failing call."""
    assert GRPCURL is not None
    command = [str(GRPCURL), "-plaintext"]
    if data is not None:
        command += ["-d", json.dumps(data)]
    command += [server.address, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=GRPCURL_TIMEOUT_S)


def grpcurl_ok(server: ServerProcess, *args: str, data: dict[str, Any] | None = None) -> str:
    finished = grpcurl(server, *args, data=data)
    assert finished.returncode == 0, finished.stderr
    return finished.stdout


def test_list_shows_inference_health_and_reflection(server: ServerProcess) -> None:
    services = set(grpcurl_ok(server, "list").split())
    assert {
        "inference.GRPCInferenceService",
        "paddlequic.v1.Control",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    } <= services


def test_list_methods_of_the_inference_service(server: ServerProcess) -> None:
    methods = set(grpcurl_ok(server, "list", "inference.GRPCInferenceService").split())
    expected = [
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelStreamInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
    ]
    assert {f"inference.GRPCInferenceService.{m}" for m in expected} <= methods


def test_describe_service(server: ServerProcess) -> None:
    text = grpcurl_ok(server, "describe", "inference.GRPCInferenceService")
    assert "inference.GRPCInferenceService is a service" in text
    assert (
        "rpc ModelInfer ( .inference.ModelInferRequest ) returns ( .inference.ModelInferResponse )"
        in text
    )
    assert (
        "rpc ModelStreamInfer ( stream .inference.ModelInferRequest ) returns "
        "( stream .inference.ModelStreamInferResponse )" in text
    )


def test_describe_method(server: ServerProcess) -> None:
    text = grpcurl_ok(server, "describe", "inference.GRPCInferenceService.ModelInfer")
    assert "inference.GRPCInferenceService.ModelInfer is a method" in text
    assert "rpc ModelInfer ( .inference.ModelInferRequest )" in text


def test_describe_message(server: ServerProcess) -> None:
    text = grpcurl_ok(server, "describe", "inference.ModelInferRequest")
    assert "inference.ModelInferRequest is a message" in text
    for field in (
        "string model_name = 1;",
        "repeated .inference.ModelInferRequest.InferInputTensor inputs = 5;",
        "repeated bytes raw_input_contents = 7;",
    ):
        assert field in text
    streamed = grpcurl_ok(server, "describe", "inference.ModelStreamInferResponse")
    assert "string error_message = 1;" in streamed
    assert ".inference.ModelInferResponse infer_response = 2;" in streamed


def test_model_metadata_call(server: ServerProcess) -> None:
    metadata = json.loads(
        grpcurl_ok(
            server, "inference.GRPCInferenceService/ModelMetadata", data={"name": "two_tower"}
        )
    )
    assert (metadata["name"], metadata["versions"], metadata["platform"]) == (
        "two_tower",
        ["1"],
        "paddle_inference",
    )
    # proto3 JSON writes int64 as strings.
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [
        ("user", "FP32", ["-1", "32"]),
        ("item", "FP32", ["-1", "48"]),
    ]
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["outputs"]] == [
        (output_names("two_tower")[0], "FP32", ["-1", "16"]),
        (output_names("two_tower")[1], "FP32", ["-1", "1"]),
    ]


def test_model_infer_with_typed_json_contents(server: ServerProcess) -> None:
    """A hand-written JSON request (typed fp32_contents, no raw bytes) gets raw output bytes back,
    which proto3 JSON shows as base64."""
    array = example_inputs("mlp", seed=7)["input"][:1]
    request = {
        "model_name": "mlp",
        "id": "from-grpcurl",
        "inputs": [
            {
                "name": "input",
                "datatype": "FP32",
                "shape": [1, 256],
                # float32 values widened to float64 print exactly and parse back exactly.
                "contents": {"fp32_contents": array.ravel().tolist()},
            }
        ],
    }
    response = json.loads(
        grpcurl_ok(server, "inference.GRPCInferenceService/ModelInfer", data=request)
    )
    assert (response["model_name"], response["model_version"], response["id"]) == (
        "mlp",
        "1",
        "from-grpcurl",
    )
    (output,) = response["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == (
        output_names("mlp")[0],
        "FP32",
        ["1", "10"],
    )
    (raw,) = response["raw_output_contents"]
    served = np.frombuffer(base64.b64decode(raw), dtype="<f4").reshape(1, 10)
    assert float(served.sum()) == pytest.approx(1.0, abs=1e-5)  # softmax
    expected = run_reference("mlp", {"input": array})[output_names("mlp")[0]]
    np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("service", ["", "mlp", "two_tower"])
def test_health_check_serving(server: ServerProcess, service: str) -> None:
    """The whole server ("") and each model by name."""
    answer = json.loads(
        grpcurl_ok(server, "grpc.health.v1.Health/Check", data={"service": service})
    )
    assert answer == {"status": "SERVING"}


def test_unknown_model_infer_is_not_found(server: ServerProcess) -> None:
    request = {
        "model_name": "no_such_model",
        "inputs": [
            {
                "name": "input",
                "datatype": "FP32",
                "shape": [1, 1],
                "contents": {"fp32_contents": [0.0]},
            }
        ],
    }
    finished = grpcurl(server, "inference.GRPCInferenceService/ModelInfer", data=request)
    assert finished.returncode == NOT_FOUND_EXIT, finished.stderr
    assert "Code: NotFound" in finished.stderr
    assert "no_such_model" in finished.stderr


def test_unknown_health_service_is_not_found(server: ServerProcess) -> None:
    finished = grpcurl(server, "grpc.health.v1.Health/Check", data={"service": "no_such_model"})
    assert finished.returncode == NOT_FOUND_EXIT, finished.stderr
    assert "Code: NotFound" in finished.stderr
