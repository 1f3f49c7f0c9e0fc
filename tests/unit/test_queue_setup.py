"""Which versions the instance queues take (queue_setup.queueable): Paddle models as before,
and Python models whose config asks for them (python_instance_queues) or, where it says
nothing, whose code names no BLS call (python_code.bls_reason: None), BYTES tensors too, never
a sequence or decoupled one."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from hypothesis import given
from hypothesis import strategies as st

from protos.inference import model_config_pb2 as mc
from service.model.parameters import ParameterError, check_parameters
from service.serving.queue_setup import queueable

BLS = "1/model.py names pb_utils.InferenceRequest (BLS calls)"  # a bls_reason

PYTHON = """
backend: "python"
max_batch_size: 8
input [ { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


def config(text: str, asked: str | None = None) -> mc.ModelConfig:
    parsed = text_format.Parse(text, mc.ModelConfig())
    if asked is not None:
        parsed.parameters["python_instance_queues"].string_value = asked
    return parsed


@pytest.mark.parametrize("asked", ["true", "TRUE", "1", "yes", "on"])
def test_a_python_model_that_asks_is_queued(asked: str) -> None:
    assert queueable(config(PYTHON, asked), None)
    check_parameters(config(PYTHON, asked))


def test_bytes_tensors_go_into_the_queues_too() -> None:
    text = PYTHON.replace(
        "TYPE_FP32, dims: [ 4 ] } ]\noutput", "TYPE_STRING, dims: [ 4 ] } ]\noutput"
    )
    assert "TYPE_STRING" in text
    assert queueable(config(text, "true"), None)


@pytest.mark.parametrize("asked", ["false", "0", "no", "off"])
def test_a_python_model_that_says_no_is_not(asked: str) -> None:
    assert not queueable(config(PYTHON, asked), None)
    check_parameters(config(PYTHON, asked))


def test_a_python_model_that_says_nothing_is_queued_unless_its_code_may_make_bls_calls() -> None:
    assert queueable(config(PYTHON), None)
    assert not queueable(config(PYTHON), BLS)
    assert queueable(config(PYTHON, "true"), BLS)  # what it says, whatever its code names


@pytest.mark.parametrize(
    "change",
    [
        ("max_batch_size: 8", "max_batch_size: 8\nsequence_batching { }"),
        ("max_batch_size: 8", "max_batch_size: 8\nmodel_transaction_policy { decoupled: true }"),
    ],
    ids=["sequence", "decoupled"],
)
def test_asking_does_not_queue_what_the_queues_cannot_carry(change: tuple[str, str]) -> None:
    text = PYTHON.replace(*change)
    assert text != PYTHON
    assert not queueable(config(text, "true"), None)
    assert not queueable(config(text), None)


@given(st.text(min_size=1, max_size=12))
def test_a_value_other_than_a_boolean_fails_the_model_naming_it(value: str) -> None:
    if value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return
    with pytest.raises(ParameterError, match="python_instance_queues"):
        check_parameters(config(PYTHON, value))
