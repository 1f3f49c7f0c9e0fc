"""config.pbtxt of Python models and ensembles, read from a repository on disk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import json_format, text_format

from protos.inference import model_config_pb2 as mc
from service.backend.python_runtime import triton_python_backend_utils as pb_utils
from service.lifecycle.repository import (
    ModelRepository,
    RepositoryError,
    auto_completed,
    check_python_tensors,
)
from service.model.config_json import config_json

PYTHON = """backend: "python" max_batch_size: 4
input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "ids" data_type: TYPE_INT64 dims: [ 8 ] } ]"""


def write(root: Path, name: str, config: str, files: dict[str, str] | None = None) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    for path, text in (files or {}).items():
        (root / name / path).parent.mkdir(parents=True, exist_ok=True)
        (root / name / path).write_text(text)


def test_a_python_model_is_its_model_py(tmp_path: Path) -> None:
    write(tmp_path, "tok", PYTHON, {"1/model.py": "class TritonPythonModel: ...\n"})
    (files,) = ModelRepository(tmp_path).load("tok").versions
    assert files.model_file == tmp_path / "tok" / "1" / "model.py"


@pytest.mark.parametrize(
    ("config", "files", "message"),
    [
        (PYTHON, {"1/other.py": ""}, "holds no model.py"),
        ('backend: "onnxruntime"', {}, "backend 'onnxruntime' is not served here"),
        ('platform: "ensemble"', {}, "ensemble_scheduling goes with platform 'ensemble'"),
        (
            'ensemble_scheduling { step [ { model_name: "m" } ] }',
            {},
            "ensemble_scheduling goes with platform 'ensemble'",
        ),
    ],
)
def test_bad_configs_are_refused_with_the_reason(
    tmp_path: Path, config: str, files: dict[str, str], message: str
) -> None:
    write(tmp_path, "m", config, files)
    with pytest.raises(RepositoryError, match=message):
        ModelRepository(tmp_path).load("m")


def test_a_directory_with_a_model_py_and_no_config_is_a_python_model(tmp_path: Path) -> None:
    """Its tensors may come from auto_complete_config when it loads (checked then)."""
    (tmp_path / "auto" / "1").mkdir(parents=True)
    (tmp_path / "auto" / "1" / "model.py").write_text("class TritonPythonModel: ...\n")
    model = ModelRepository(tmp_path).load("auto")
    assert (model.config.backend, len(model.config.input)) == ("python", 0)
    with pytest.raises(RepositoryError, match="must list its inputs and outputs"):
        check_python_tensors(model.config)


def completed(config: mc.ModelConfig, change: str) -> bytes:
    done = mc.ModelConfig()
    done.CopyFrom(config)
    text_format.Merge(change, done)
    return done.SerializeToString()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("model_transaction_policy { decoupled: true }", "changes model_transaction_policy"),
        ('name: "other"', "changes its name or backend"),
        ("max_batch_size: -1", "max_batch_size must be >= 0"),
    ],
)
def test_what_auto_complete_config_may_not_change(change: str, reason: str) -> None:
    config = text_format.Parse(f'name: "m" {PYTHON}', mc.ModelConfig())
    with pytest.raises(RepositoryError, match=reason):
        auto_completed(config, completed(config, change))


def test_auto_complete_config_adds_and_agrees_as_tritons() -> None:
    """pb_utils.ModelConfig: what config.pbtxt says wins; a contradiction fails the load."""
    given = pb_utils.ModelConfig(
        config_json(text_format.Parse(f'name: "m" {PYTHON}', mc.ModelConfig()))
    )
    given.add_input({"name": "text", "data_type": "TYPE_STRING", "dims": [1]})  # the same
    with pytest.raises(ValueError, match="has dims"):
        given.add_input({"name": "text", "data_type": "TYPE_STRING", "dims": [2]})
    with pytest.raises(ValueError, match="must have"):
        given.add_output({"name": "extra", "data_type": "TYPE_FP32"})
    with pytest.raises(ValueError, match="sets max_batch_size 4"):
        given.set_max_batch_size(2)
    given.add_output({"name": "score", "data_type": "TYPE_FP32", "dims": [1]})
    given.set_dynamic_batching()
    done = auto_completed(
        text_format.Parse(f'name: "m" {PYTHON}', mc.ModelConfig()),
        json_format.ParseDict(given.as_dict(), mc.ModelConfig()).SerializeToString(),
    )
    assert [o.name for o in done.output] == ["ids", "score"] and done.HasField("dynamic_batching")


def test_an_ensemble_needs_no_version_directory(tmp_path: Path) -> None:
    write(
        tmp_path,
        "e",
        'platform: "ensemble" ensemble_scheduling { step [ { model_name: "m" } ] }',
    )
    (files,) = ModelRepository(tmp_path).load("e").versions
    assert files.version == 1


def test_triton_utils_read_the_config_as_triton_passes_it() -> None:
    config = '{"output": [{"name": "ids", "data_type": "TYPE_INT64", "dims": ["8"]}]}'
    entry = pb_utils.get_output_config_by_name(config, "ids")
    assert entry is not None and pb_utils.triton_string_to_numpy(entry["data_type"]) is np.int64
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    request = pb_utils.InferenceRequest([pb_utils.Tensor("text", np.array([b"x"]))], ["ids"])
    tensor = pb_utils.get_input_tensor_by_name(request, "text")
    assert tensor is not None and tensor.as_numpy().tolist() == [b"x"]
    assert pb_utils.get_input_tensor_by_name(request, "nope") is None
    failed = pb_utils.InferenceResponse(error=pb_utils.TritonError("no"))
    assert failed.has_error() and failed.error() is not None


@pytest.mark.parametrize(
    ("text", "decoupled"),
    [
        ("", False),
        ("model_transaction_policy { }", False),
        ("model_transaction_policy { decoupled: false }", False),
        ("model_transaction_policy { decoupled: true }", True),
    ],
)
def test_triton_utils_tell_a_decoupled_config(text: str, decoupled: bool) -> None:
    """From the config JSON Python models are given (Triton's function, Triton's field)."""
    config = config_json(text_format.Parse(f'name: "m" {text}', mc.ModelConfig()))
    assert pb_utils.using_decoupled_model_transaction_policy(config) is decoupled
    assert pb_utils.using_decoupled_model_transaction_policy(json.loads(config)) is decoupled


def test_a_request_of_a_model_that_is_not_decoupled_has_no_sender() -> None:
    request = pb_utils.InferenceRequest([], ["ids"])
    assert not request.is_cancelled()
    assert (request.request_id(), json.loads(request.parameters())) == ("", {})
    with pytest.raises(pb_utils.TritonModelException, match="needs a decoupled model"):
        request.get_response_sender()
