"""triton_python_backend_utils as a Triton model.py uses it: every name of Triton's module a
model may call exists here, and what paddlequic does not implement raises an error naming it
when called (never an AttributeError when model.py is imported or run)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.backend.python_runtime import triton_python_backend_utils as pb_utils

# Triton's python_backend: its module's functions and classes, and those its stub adds.
TRITON_NAMES = [
    "TRITON_STRING_TO_NUMPY",
    "serialize_byte_tensor",
    "deserialize_bytes_tensor",
    "get_input_tensor_by_name",
    "get_output_tensor_by_name",
    "get_input_config_by_name",
    "get_output_config_by_name",
    "using_decoupled_model_transaction_policy",
    "triton_to_numpy_type",
    "numpy_to_triton_type",
    "triton_string_to_numpy",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TritonError",
    "TritonModelException",
    "Tensor",
    "InferenceRequest",
    "InferenceResponse",
    "Logger",
    "PreferredMemory",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_MEMORY_CPU",
    "MetricFamily",
    "load_model",
    "unload_model",
    "is_model_ready",
]
REQUEST_METHODS = [
    "inputs", "requested_output_names", "request_id", "correlation_id", "flags", "set_flags",
    "timeout", "parameters", "trace", "exec", "async_exec", "get_response_sender",
    "is_cancelled", "set_release_flags",
]  # fmt: skip
TENSOR_METHODS = [
    "name", "as_numpy", "triton_dtype", "to_dlpack", "is_cpu", "shape", "from_dlpack",
    "__dlpack__", "__dlpack_device__",
]  # fmt: skip


def test_every_name_of_tritons_module_exists() -> None:
    assert [n for n in TRITON_NAMES if not hasattr(pb_utils, n)] == []
    assert [m for m in REQUEST_METHODS if not hasattr(pb_utils.InferenceRequest, m)] == []
    assert [m for m in TENSOR_METHODS if not hasattr(pb_utils.Tensor, m)] == []
    for method in ("output_tensors", "has_error", "error", "parameters"):
        assert hasattr(pb_utils.InferenceResponse, method)


@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("load_model", lambda: pb_utils.load_model("m")),
        ("unload_model", lambda: pb_utils.unload_model("m")),
        ("is_model_ready", lambda: pb_utils.is_model_ready("m")),
        ("InferenceRequest.trace", lambda: pb_utils.InferenceRequest([], []).trace()),
        (
            "InferenceRequest.set_release_flags",
            lambda: pb_utils.InferenceRequest([], []).set_release_flags(2),
        ),
    ],
)
def test_what_is_not_implemented_says_so_by_name(name: str, call: Any) -> None:
    with pytest.raises(pb_utils.TritonModelException, match=f"pb_utils.{name} is not implemented"):
        call()


@given(st.lists(st.binary(max_size=8) | st.text(max_size=4), min_size=1, max_size=6))
def test_bytes_tensors_serialize_as_tritons(items: list[bytes | str]) -> None:
    array = np.empty(len(items), dtype=np.object_)
    array[:] = items
    encoded = pb_utils.serialize_byte_tensor(array)
    expected = [i if isinstance(i, bytes) else i.encode() for i in items]
    assert pb_utils.deserialize_bytes_tensor(encoded).tolist() == expected


def test_type_numbers_and_dlpack() -> None:
    for name, numpy_type in pb_utils.TRITON_STRING_TO_NUMPY.items():
        number = pb_utils.numpy_to_triton_type(numpy_type)
        assert number is not None and pb_utils.triton_to_numpy_type(number) is numpy_type, name
    assert pb_utils.numpy_to_triton_type(np.float32) == 11  # TYPE_FP32
    tensor = pb_utils.Tensor("x", np.arange(3, dtype=np.int32))
    assert tensor.triton_dtype() == 8  # TYPE_INT32
    copied = pb_utils.Tensor.from_dlpack("y", tensor)
    assert copied.as_numpy().tolist() == [0, 1, 2] and copied.name() == "y"
