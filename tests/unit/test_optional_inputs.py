"""Triton's `optional: true` inputs (service/inference/validation.py): a decoupled model's
request may leave them out (its execute() sees what was sent); every other model still needs
every input, since a batch or a Paddle program would lack (or silently reuse) it."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.protobuf import text_format
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.inference_client import build_request
from protos.inference import model_config_pb2 as mc
from service.inference.errors import ServiceError
from service.inference.validation import RequestValidator

CONFIG = """
name: "m"
backend: "python"
max_batch_size: 0
input [
  { name: "text", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "temperature", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "seed", data_type: TYPE_INT64, dims: [ 1 ], optional: true }
]
output [ { name: "out", data_type: TYPE_STRING, dims: [ 1 ] } ]
"""
VALUES = {
    "text": np.array([b"hi"], np.object_),
    "temperature": np.array([0.5], np.float32),
    "seed": np.array([3], np.int64),
}


def validator(decoupled: bool) -> RequestValidator:
    config = text_format.Parse(CONFIG, mc.ModelConfig())
    config.model_transaction_policy.decoupled = decoupled
    return RequestValidator(config)


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(st.sets(st.sampled_from(sorted(VALUES))), st.booleans())
def test_only_a_decoupled_model_may_be_sent_fewer_inputs(sent: set[str], decoupled: bool) -> None:
    request = build_request("m", {name: VALUES[name] for name in sorted(sent)})
    required_missing = "text" not in sent or (not decoupled and sent != set(VALUES))
    if required_missing:
        with pytest.raises(ServiceError) as refused:
            validator(decoupled).validate(request)
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "missing input" in str(refused.value)
    else:
        job = validator(decoupled).validate(request)
        assert sorted(t.name for t in job.inputs) == sorted(sent)
