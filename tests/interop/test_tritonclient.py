"""Triton's own Python client (tritonclient[grpc]) against the real server, unmodified.

tritonclient cannot be imported beside our generated protos (duplicate descriptor pool symbols
such as inference.ServerLiveRequest), so tritonclient_check.py runs it in one subprocess for
the whole module; the tests here only check what it recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.reference import EXAMPLES, example_inputs, output_names, run_reference
from tests.servers import REPO_ROOT, ServerProcess

Array = np.ndarray[Any, Any]
SCRIPT = Path(__file__).with_name("tritonclient_check.py")
CHECK_TIMEOUT_S = 300
# Stream requests in send order: good mlp requests with a malformed one in the middle.
STREAM_GOOD = [f"ok-{i}" for i in range(6)]
STREAM_BAD = "bad"
STREAM_ORDER = [*STREAM_GOOD[:3], STREAM_BAD, *STREAM_GOOD[3:]]


def _stream_inputs(request_id: str) -> dict[str, Array]:
    if request_id == STREAM_BAD:
        return {"input": np.zeros((2, 255), np.float32)}
    return example_inputs("mlp", seed=100 + STREAM_GOOD.index(request_id))


@dataclass(frozen=True)
class CheckRun:
    summary: dict[str, Any]
    outputs: dict[str, Array]


@pytest.fixture(scope="module")
def triton(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> CheckRun:
    """One run of the tritonclient script; every test below reads its results."""
    directory = tmp_path_factory.mktemp("tritonclient")
    inputs, out = directory / "inputs.npz", directory / "out.npz"
    arrays = {
        f"infer.{model}.{name}": array
        for model in EXAMPLES
        for name, array in example_inputs(model).items()
    }
    for request_id in STREAM_ORDER:
        for name, array in _stream_inputs(request_id).items():
            arrays[f"stream.{request_id}.{name}"] = array
    np.savez(inputs, **arrays)  # type: ignore[arg-type]
    command = [sys.executable, str(SCRIPT), "--url", server.address]
    command += ["--inputs", str(inputs), "--out", str(out)]
    finished = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
    )
    assert finished.returncode == 0, finished.stderr
    with np.load(out) as data:
        summary = json.loads(str(data["summary"]))
        outputs = {name: data[name] for name in data.files if name != "summary"}
    return CheckRun(summary, outputs)


def test_no_check_raised(triton: CheckRun) -> None:
    """Any exception tritonclient raised (e.g. a response it cannot parse) shows up here."""
    assert triton.summary.get("errors", {}) == {}


def test_server_live_ready_and_metadata(triton: CheckRun) -> None:
    assert triton.summary["live"] is True
    assert triton.summary["ready"] is True
    assert triton.summary["server_metadata"]["name"]


# Outputs by position: their names are the example configs' (output_names).
EXPECTED_SHAPES = {
    "mlp": ([("input", "FP32", [-1, 256])], [("FP32", [-1, 10])]),
    "resnet18": ([("image", "FP32", [-1, 3, 224, 224])], [("FP32", [-1, 1000])]),
    "text_classifier": ([("token_ids", "INT64", [-1, -1])], [("FP32", [-1, 4])]),
    "two_tower": (
        [("user", "FP32", [-1, 32]), ("item", "FP32", [-1, 48])],
        [("FP32", [-1, 16]), ("FP32", [-1, 1])],
    ),
}


def expected_metadata(
    model: str,
) -> tuple[list[tuple[str, str, list[int]]], list[tuple[str, str, list[int]]]]:
    inputs, outputs = EXPECTED_SHAPES[model]
    names = output_names(model)
    return inputs, [(n, d, s) for n, (d, s) in zip(names, outputs, strict=True)]


# Triton's model_config.proto DataType numbers, as tritonclient's own message decodes them.
TRITON_DATA_TYPES = {"INT64": 9, "FP32": 11}


def _triples(tensors: list[dict[str, Any]]) -> list[tuple[str, str, list[int]]]:
    return [(t["name"], t["datatype"], t["shape"]) for t in tensors]


@pytest.mark.parametrize("model", EXAMPLES)
def test_model_metadata(triton: CheckRun, model: str) -> None:
    metadata = triton.summary[f"metadata.{model}"]
    assert (metadata["name"], metadata["versions"], metadata["platform"]) == (
        model,
        ["1"],
        "paddle_inference",
    )
    assert metadata["ready"] is True
    inputs, outputs = expected_metadata(model)
    assert _triples(metadata["inputs"]) == inputs
    assert _triples(metadata["outputs"]) == outputs


@pytest.mark.parametrize("model", EXAMPLES)
def test_model_config_parses_in_tritonclient(triton: CheckRun, model: str) -> None:
    """Our ModelConfig reuses Triton's field numbers, so Triton's message must read it back."""
    config = triton.summary[f"config.{model}"]
    assert (config["name"], config["platform"]) == (model, "paddle_inference")
    assert config["max_batch_size"] > 0
    inputs, outputs = expected_metadata(model)
    assert [name for name, _, _ in config["inputs"]] == [name for name, _, _ in inputs]
    assert [name for name, _, _ in config["outputs"]] == [name for name, _, _ in outputs]
    # dims exclude the batch dimension when max_batch_size > 0.
    assert [dims for _, _, dims in config["inputs"]] == [shape[1:] for _, _, shape in inputs]
    assert [dtype for _, dtype, _ in config["inputs"]] == [
        TRITON_DATA_TYPES[datatype] for _, datatype, _ in inputs
    ]
    assert [dtype for _, dtype, _ in config["outputs"]] == [
        TRITON_DATA_TYPES[datatype] for _, datatype, _ in outputs
    ]


def test_repository_index(triton: CheckRun) -> None:
    assert triton.summary["repository_index"] == [[model, "1", "READY"] for model in EXAMPLES]


@pytest.mark.parametrize("model", EXAMPLES)
def test_model_infer_matches_in_process_paddle(triton: CheckRun, model: str) -> None:
    response = triton.summary[f"infer.{model}"]
    assert (response["id"], response["model_name"], response["model_version"]) == (
        f"infer-{model}",
        model,
        "1",
    )
    expected = run_reference(model, example_inputs(model))
    assert [t["name"] for t in response["outputs"]] == list(expected)
    for name, array in expected.items():
        served = triton.outputs[f"infer.{model}.{name}"]
        assert served.dtype == array.dtype
        assert served.shape == array.shape
        np.testing.assert_allclose(served, array, rtol=1e-4, atol=1e-5)


def test_unknown_model_is_not_found(triton: CheckRun) -> None:
    error = triton.summary["unknown_model"]
    assert error["status"] == "StatusCode.NOT_FOUND"
    assert "no_such_model" in error["message"]


def test_stream_bad_request_gets_an_error_and_the_stream_goes_on(triton: CheckRun) -> None:
    stream = triton.summary["stream"]
    assert stream["sent"] == STREAM_ORDER
    arrivals = stream["arrivals"]
    assert len(arrivals) == len(STREAM_ORDER)
    errors = [a["error"] for a in arrivals if "error" in a]
    assert len(errors) == 1, errors
    message = errors[0]["message"]
    assert "256" in message and "255" in message, message
    assert sorted(a["id"] for a in arrivals if "id" in a) == sorted(STREAM_GOOD)
    assert all(a["model_name"] == "mlp" for a in arrivals if "id" in a)


@pytest.mark.parametrize("request_id", STREAM_GOOD)
def test_stream_good_requests_match_in_process_paddle(triton: CheckRun, request_id: str) -> None:
    expected = run_reference("mlp", _stream_inputs(request_id))[output_names("mlp")[0]]
    served = triton.outputs[f"stream.{request_id}.output0"]
    assert served.shape == expected.shape
    np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-5)
