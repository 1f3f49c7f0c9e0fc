"""The part of Triton's Python backend API (`import triton_python_backend_utils as pb_utils`)
that pre/post-processing models use, so their model.py runs here unchanged. Python-model
workers make this module importable under that name before they import model.py."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

_NUMPY_OF_TYPE = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


class TritonError:
    def __init__(self, message: str) -> None:
        self._message = message

    def message(self) -> str:
        return self._message


class TritonModelException(Exception):
    pass


class Tensor:
    def __init__(self, name: str, array: Any) -> None:
        self._name = name
        self._array = np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray[Any, Any]:
        return self._array

    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    def is_cpu(self) -> bool:
        return True


class InferenceRequest:
    """One request as execute() receives it (a whole batch of rows, here)."""

    def __init__(self, inputs: Sequence[Tensor], requested_output_names: Sequence[str]) -> None:
        self._inputs = list(inputs)
        self._outputs = list(requested_output_names)

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._outputs)

    def get_input_tensor_by_name(self, name: str) -> Tensor | None:
        return get_input_tensor_by_name(self, name)


class InferenceResponse:
    def __init__(
        self, output_tensors: Iterable[Tensor] = (), error: TritonError | None = None
    ) -> None:
        self._outputs = list(output_tensors)
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: Any, name: str) -> dict[str, Any] | None:
    return _config_entry(model_config, "input", name)


def get_output_config_by_name(model_config: Any, name: str) -> dict[str, Any] | None:
    return _config_entry(model_config, "output", name)


def triton_string_to_numpy(triton_type: str) -> Any:
    return _NUMPY_OF_TYPE[triton_type]


def _config_entry(model_config: Any, kind: str, name: str) -> dict[str, Any] | None:
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    return next((e for e in config.get(kind, []) if e.get("name") == name), None)
