"""What a sequence_batching config may say (service/model/sequences.py): every wrong one is
refused when the model is read, with the reason, never per request."""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from protos.inference import model_config_pb2 as mc
from service.model.sequences import (
    MAX_STATE_BYTES,
    SequenceConfigError,
    sequence_settings,
    with_sequence_tensors,
    without_sequence_tensors,
)

BASE = """
name: "m"
max_batch_size: 8
input [ { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 2 ] } ]
"""
GOOD = """
sequence_batching {
  control_input [
    { name: "start", control [ { kind: CONTROL_SEQUENCE_START, int32_false_true: [ 0, 1 ] } ] },
    { name: "corrid", control [ { kind: CONTROL_SEQUENCE_CORRID, data_type: TYPE_UINT64 } ] }
  ]
  state [ { input_name: "h", output_name: "h_out", data_type: TYPE_FP32, dims: [ 3 ] } ]
}
"""


def config(text: str, base: str = BASE) -> mc.ModelConfig:
    return text_format.Parse(base + text, mc.ModelConfig())


def test_a_good_config_and_what_callers_see_of_it() -> None:
    parsed = config(GOOD)
    settings = sequence_settings(parsed)
    assert settings is not None
    assert not settings.oldest and settings.idle_s == 1.0  # Triton's defaults
    assert settings.hidden_inputs() == ("start", "corrid", "h")
    engine = with_sequence_tensors(parsed, settings)
    assert [i.name for i in engine.input] == ["x", "start", "corrid", "h"]
    assert [o.name for o in engine.output] == ["y", "h_out"]
    seen = without_sequence_tensors(engine, settings)
    assert [i.name for i in seen.input] == ["x"] and [o.name for o in seen.output] == ["y"]
    assert sequence_settings(config("")) is None


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            'sequence_batching { control_input [ { name: "s" } ] }',
            "exactly one control",
        ),
        (
            'sequence_batching { control_input [ { name: "s", control [ { kind: '
            "CONTROL_SEQUENCE_END } ] } ] }",
            "two values (false, true)",
        ),
        (
            'sequence_batching { control_input [ { name: "s", control [ { kind: '
            "CONTROL_SEQUENCE_CORRID, data_type: TYPE_FP32 } ] } ] }",
            "TYPE_UINT64",
        ),
        (
            'sequence_batching { state [ { input_name: "h", output_name: "o", data_type: '
            "TYPE_FP32, dims: [ -1 ] } ] }",
            "fixed shape",
        ),
        (
            'sequence_batching { state [ { input_name: "h", output_name: "o", data_type: '
            'TYPE_FP32, dims: [ 2 ], initial_state { data_file: "f" } } ] }',
            "zero_data",
        ),
        (
            'sequence_batching { state [ { input_name: "x", output_name: "o", data_type: '
            "TYPE_FP32, dims: [ 2 ] } ] }",
            "do not list it in `input`",
        ),
        (
            'sequence_batching { state [ { input_name: "h", output_name: "y", data_type: '
            "TYPE_FP32, dims: [ 2 ] } ] }",
            "do not list it in `output`",
        ),
        (
            'sequence_batching { state [ { input_name: "h", output_name: "o", data_type: '
            f"TYPE_FP32, dims: [ {MAX_STATE_BYTES // 4 + 1} ] }} ] }}",
            "bytes per sequence",
        ),
        ("sequence_batching { iterative_sequence: true }", "iterative_sequence"),
        (
            "sequence_batching { } model_transaction_policy { decoupled: true }",
            "decoupled",
        ),
        (
            'sequence_batching { } parameters { key: "fallback_model" value: '
            '{ string_value: "other" } }',
            "fallback_model",
        ),
        (
            'sequence_batching { } model_warmup [ { name: "w", batch_size: 1 } ]',
            "model_warmup",
        ),
        ("sequence_batching { oldest { max_candidate_sequences: -1 } }", ">= 1"),
    ],
)
def test_a_wrong_config_is_refused_with_its_reason(text: str, reason: str) -> None:
    with pytest.raises(SequenceConfigError) as refused:
        sequence_settings(config(text))
    assert reason in str(refused.value)


def test_a_sequence_model_lists_its_tensors() -> None:
    with pytest.raises(SequenceConfigError) as refused:
        sequence_settings(config("sequence_batching { }", base='name: "m"'))
    assert "must list its inputs and outputs" in str(refused.value)
