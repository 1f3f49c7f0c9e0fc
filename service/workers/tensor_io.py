"""Tensors in a worker's shared memory (or inline in a decoupled request's messages):
fixed-size datatypes as their bytes, BYTES tensors (numpy object arrays in the worker) in the
protocol's length-prefixed form."""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from typing import Any

import numpy as np

from oip.bytes_tensor import serialize_bytes, to_numpy_bytes
from oip.datatypes import is_bytes
from service.workers.protocol import TensorRef


def input_array(buffer: mmap.mmap | bytes, ref: TensorRef) -> np.ndarray[Any, Any]:
    if is_bytes(ref.dtype):
        return to_numpy_bytes(buffer[ref.offset : ref.offset + ref.nbytes], ref.shape)
    return np.ndarray(ref.shape, np.dtype(ref.dtype), buffer=buffer, offset=ref.offset)


def wire_form(array: np.ndarray[Any, Any]) -> tuple[str, np.ndarray[Any, Any]]:
    """The dtype string the front-end is told, and the bytes to write (flat uint8)."""
    if is_bytes(array.dtype):
        data = serialize_bytes(bytes(v) for v in array.flat)
        return array.dtype.str, np.frombuffer(data, np.uint8)
    return array.dtype.str, np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def inline_arrays(
    arrays: Iterable[tuple[str, np.ndarray[Any, Any]]],
) -> tuple[tuple[TensorRef, ...], bytes]:
    """Arrays as a message carries them inline (a decoupled Response, a BLS call): one
    buffer, each in its wire form, and where each lies in it."""
    refs, chunks, offset = [], [], 0
    for name, array in arrays:
        dtype, data = wire_form(array)
        refs.append(TensorRef(name, dtype, array.shape, offset, data.nbytes))
        chunks.append(data.data)
        offset += data.nbytes
    return tuple(refs), b"".join(chunks)
