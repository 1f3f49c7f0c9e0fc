"""numpy arrays <-> the protocol's request and response messages (raw contents, little-endian;
BYTES elements length-prefixed), shared by the unary and the streaming calls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from oip.bytes_tensor import serialize_bytes, to_numpy_bytes
from oip.datatypes import BY_NAME, from_numpy, is_bytes
from protos.inference import grpc_service_pb2 as pb

Parameter = bool | int | float | str


def set_parameter(target: pb.InferParameter, value: Parameter) -> None:
    """bool before int: a bool is an int to Python, not to the protocol."""
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = value


def build_request(
    model: str,
    inputs: Mapping[str, np.ndarray[Any, Any]],
    outputs: Sequence[str] = (),
    version: str = "",
    request_id: str = "",
    parameters: Mapping[str, Parameter] | None = None,
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for key, value in (parameters or {}).items():
        set_parameter(request.parameters[key], value)
    for name, array in inputs.items():
        datatype = from_numpy(array.dtype).name
        request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        if datatype == "BYTES":
            request.raw_input_contents.append(
                serialize_bytes(v.encode() if isinstance(v, str) else bytes(v) for v in array.flat)
            )
            continue
        little_endian = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        request.raw_input_contents.append(little_endian.tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    return request


def parse_response(response: pb.ModelInferResponse) -> dict[str, np.ndarray[Any, Any]]:
    arrays = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        if tensor.datatype == "BYTES":
            arrays[tensor.name] = to_numpy_bytes(raw, tensor.shape)
            continue
        dtype = BY_NAME[tensor.datatype].numpy
        arrays[tensor.name] = np.frombuffer(raw, dtype=dtype).reshape(tuple(tensor.shape))
    return arrays


def random_array(
    datatype: str, shape: Sequence[int], rng: np.random.Generator
) -> np.ndarray[Any, Any]:
    """Random values of a protocol datatype: normal floats, booleans, or small integers (so
    embedding ids stay in range)."""
    dtype = BY_NAME[datatype].numpy
    if is_bytes(dtype) or datatype == "BF16":  # no numpy values build_request would send as such
        raise ValueError(f"no random values for {datatype} inputs")
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(0, 100, shape).astype(dtype)
