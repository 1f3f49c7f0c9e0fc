"""The KServe SDK's REST client (v2 protocol: JSON tensors, with and without numpy, and binary
tensors) and its gRPC client, unmodified and in a process of their own, against the real server
with one process and with front-ends: health, model readiness, each answer compared by value with
in-process Paddle, and a bad request refused with the SDK's error for a 400."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.reference import example_inputs, run_reference
from tests.servers import (
    HTTP_PORT,
    REPO_ROOT,
    ServerProcess,
    model_repository,
    running_server,
)

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).with_name("kserve_check.py")
MODELS = ("mlp", "text_classifier")  # FP32 and INT64 inputs
DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}
# A client process: kserve imports pandas and the kubernetes client, slow on a loaded machine.
CLIENT_TIMEOUT_S = 240


@pytest.fixture(scope="module", params=["one process", "front-ends"])
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[ServerProcess, int]]:
    root = tmp_path_factory.mktemp(request.param.replace(" ", "-"))
    repository = model_repository(root / "models", MODELS)
    frontends = ("--frontends", "2") if request.param == "front-ends" else ()
    args = ("--http-port", HTTP_PORT, *frontends)
    with running_server(repository, root / "server.log", args) as server:
        yield server, server.http_port


@pytest.fixture(scope="module")
def answers(served: tuple[ServerProcess, int]) -> dict[str, Any]:
    """What the SDK's clients got, run once per server."""
    server, port = served
    calls = {
        model: {
            name: [DATATYPES[array.dtype], array.tolist()]
            for name, array in example_inputs(model).items()
        }
        for model in MODELS
    }
    given = {"rest": f"http://127.0.0.1:{port}", "grpc": server.address, "calls": calls}
    done = subprocess.run(
        [sys.executable, str(SCRIPT)],
        input=json.dumps(given),
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr
    got: dict[str, Any] = json.loads(done.stdout)
    return got


def assert_reference(model: str, answer: dict[str, Any]) -> None:
    assert answer["id"] == "kserve-sdk" and answer["model"] == model
    expected = run_reference(model, example_inputs(model))
    assert list(answer["outputs"]) == list(expected)
    for name, array in expected.items():
        served = answer["outputs"][name]
        assert served["shape"] == list(array.shape) and served["datatype"] == "FP32"
        np.testing.assert_allclose(served["data"], array, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("model", MODELS)
def test_the_rest_client_gets_paddles_answers_as_json_and_binary(
    answers: dict[str, Any], model: str
) -> None:
    rest = answers["rest"]
    assert rest["live"] is True and rest["ready"] is True
    assert rest[model]["model_ready"] is True
    for way in ("json", "numpy_json", "binary"):
        assert_reference(model, rest[model][way])


def test_the_rest_client_reads_unknown_models_as_not_ready(answers: dict[str, Any]) -> None:
    assert answers["rest"]["unknown_model_ready"] is False


@pytest.mark.parametrize("model", MODELS)
def test_a_bad_shape_is_the_rest_clients_400_with_the_servers_reason(
    answers: dict[str, Any], model: str
) -> None:
    refused = answers["rest"][model]["wrong_shape"]
    assert refused is not None and refused["status"] == 400
    assert "shape" in refused["message"].lower()


@pytest.mark.parametrize("model", MODELS)
def test_the_grpc_client_gets_paddles_answers(answers: dict[str, Any], model: str) -> None:
    grpc_side = answers["grpc"]
    assert grpc_side["live"] is True and grpc_side["ready"] is True
    assert grpc_side[model]["model_ready"] is True
    assert_reference(model, grpc_side[model]["binary"])
