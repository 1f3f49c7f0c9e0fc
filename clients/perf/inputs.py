"""The request perf sends, built once from the model's metadata and serialized once: every
call then sends the same bytes, so the client spends its CPU on the transport, not on protobuf."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clients.tensors import Parameter, build_request, random_array
from oip.datatypes import from_numpy
from protos.inference import grpc_service_pb2 as pb

INPUT_DATA = ("random", "zero")


def parse_shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """`NAME:d0,d1,...` (perf_analyzer's --shape): an input's dims, without the batch dim for
    a model that batches."""
    shapes = {}
    for item in items:
        name, sep, dims = item.rpartition(":")
        try:
            shape = tuple(int(d) for d in dims.split(","))
        except ValueError:
            shape = ()
        if not sep or not name or not shape or any(d < 0 for d in shape):
            raise ValueError(f"--shape takes NAME:d0,d1,... with dims >= 0, got {item!r}")
        shapes[name] = shape
    return shapes


def request_shape(
    tensor: pb.ModelMetadataResponse.TensorMetadata,
    batched: bool,
    batch_size: int,
    shapes: Mapping[str, tuple[int, ...]],
) -> tuple[int, ...]:
    """The shape sent for one input: the batch size first when the model batches, then the
    --shape dims or the metadata's; a variable dim left over is an error naming the flag."""
    declared = tuple(int(d) for d in tensor.shape)
    dims = shapes.get(tensor.name, declared[1:] if batched else declared)
    if any(d < 0 for d in dims):
        raise ValueError(
            f"input {tensor.name!r} has variable dims {list(declared)}: give them with "
            f"--shape {tensor.name}:" + ",".join("16" if d < 0 else str(d) for d in dims)
        )
    return ((batch_size,) if batched else ()) + tuple(dims)


def model_inputs(
    metadata: pb.ModelMetadataResponse,
    batched: bool,
    batch_size: int,
    shapes: Mapping[str, tuple[int, ...]],
    data: str,
    seed: int = 0,
    optional: frozenset[str] = frozenset(),
) -> dict[str, np.ndarray[Any, Any]]:
    """`data`: random, zero, or a directory holding NAME.npy for each input (used as is; an
    `optional` input without its file is left out). BYTES inputs (text) need the directory."""
    unknown = sorted(set(shapes) - {t.name for t in metadata.inputs})
    if unknown:
        raise ValueError(f"--shape names no input of the model: {unknown}")
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for tensor in metadata.inputs:
        if data not in INPUT_DATA:
            path = Path(data) / f"{tensor.name}.npy"
            if tensor.name not in optional or path.is_file():
                arrays[tensor.name] = _from_file(path, tensor.datatype)
            continue
        if tensor.datatype == "BYTES":
            raise ValueError(
                f"input {tensor.name!r} is BYTES: give its values with --input-data DIR holding "
                f"{tensor.name}.npy (e.g. np.save('DIR/{tensor.name}.npy', np.array([b'...'])))"
            )
        shape = request_shape(tensor, batched, batch_size, shapes)
        if data == "zero":
            arrays[tensor.name] = np.zeros(shape, random_array(tensor.datatype, (), rng).dtype)
        else:
            arrays[tensor.name] = random_array(tensor.datatype, shape, rng)
    return arrays


def _from_file(path: Path, datatype: str) -> np.ndarray[Any, Any]:
    if not path.is_file():
        raise ValueError(f"--input-data: {path} is missing (one NAME.npy per input)")
    array: np.ndarray[Any, Any] = np.load(path)
    held = from_numpy(array.dtype).name
    if held != datatype:
        raise ValueError(f"{path} holds {held}, the model wants {datatype}")
    return array


def serialized_request(
    model: str,
    version: str,
    inputs: Mapping[str, np.ndarray[Any, Any]],
    parameters: Mapping[str, Parameter] | None = None,
) -> bytes:
    return build_request(model, inputs, version=version, parameters=parameters).SerializeToString()
