"""The Open Inference Protocol's encoding of a BYTES tensor in raw contents (tritonclient's):
each element, row-major, is a 4-byte little-endian length followed by its contents. The server
keeps BYTES tensors in this form from the request to the worker and back."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

_LENGTH = struct.Struct("<I")


def serialize_bytes(values: Iterable[bytes]) -> bytes:
    """tritonclient's encoding of a BYTES tensor (row-major elements)."""
    return b"".join(_LENGTH.pack(len(v)) + v for v in values)


def deserialize_bytes(data: bytes | memoryview) -> list[bytes]:
    """The elements of a serialized BYTES tensor; ValueError when a length runs past the end
    (a length is never trusted beyond the bytes actually sent)."""
    view = memoryview(data)
    elements, offset = [], 0
    while offset < len(view):
        if offset + _LENGTH.size > len(view):
            raise ValueError(f"a BYTES element length at byte {offset} is cut short")
        (size,) = _LENGTH.unpack_from(view, offset)
        offset += _LENGTH.size
        if offset + size > len(view):
            raise ValueError(
                f"a BYTES element at byte {offset} claims {size} bytes; only "
                f"{len(view) - offset} remain"
            )
        elements.append(bytes(view[offset : offset + size]))
        offset += size
    return elements


def split_bytes(data: bytes | memoryview, counts: Sequence[int]) -> list[bytes]:
    """A serialized BYTES tensor cut into consecutive parts of `counts` elements each."""
    view = memoryview(data)
    parts, offset = [], 0
    for count in counts:
        start = offset
        for _ in range(count):
            (size,) = _LENGTH.unpack_from(view, offset)
            offset += _LENGTH.size + size
        parts.append(bytes(view[start:offset]))
    return parts


def to_numpy_bytes(data: bytes, shape: Sequence[int]) -> np.ndarray[Any, np.dtype[Any]]:
    """A serialized BYTES tensor as the object array Triton's Python models receive."""
    array = np.empty(len(elements := deserialize_bytes(data)), dtype=object)
    array[:] = elements
    return array.reshape(tuple(shape))
