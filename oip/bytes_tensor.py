"""The Open Inference Protocol's encoding of a BYTES tensor in raw contents (tritonclient's):
each element, row-major, is a 4-byte little-endian length followed by its contents. The server
keeps BYTES tensors in this form from the request to the worker and back.

Every reader here is told how many elements the tensor's shape declares and walks at most that
many, so the work is bounded by the shape, never by the bytes a peer sent: a [1, 1] tensor
carrying millions of empty elements costs one length read and a comparison."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class BytesScan:
    """What a walk over a serialized BYTES tensor found, and what it cost."""

    elements: int  # whole elements found, at most the count the walk was given
    lengths_read: int  # 4-byte length prefixes read: the walk's work, at most that count
    trailing: int  # bytes after the last element found (0: the data ends there)
    problem: str  # why the data is malformed, or ""

    def matches(self, count: int) -> bool:
        return not self.problem and self.elements == count and not self.trailing

    def held(self) -> str:
        """How many elements the data holds, as far as the walk knows."""
        if self.trailing:
            return f"more ({self.trailing} bytes follow element {self.elements})"
        return str(self.elements)


def scan_bytes(data: bytes | memoryview, count: int, keep: list[bytes] | None = None) -> BytesScan:
    """Walk at most `count` elements (appending each to `keep` if given); never copies, and
    stops at the first element past `count`, a cut-short length or a length that runs past
    the end (a length is never trusted beyond the bytes actually sent)."""
    view = memoryview(data)
    end, offset, read = len(view), 0, 0
    while read < count and offset < end:
        if offset + _LENGTH.size > end:
            problem = f"a BYTES element length at byte {offset} is cut short"
            return BytesScan(read, read, end - offset, problem)
        (size,) = _LENGTH.unpack_from(view, offset)
        read += 1
        start = offset + _LENGTH.size
        if start + size > end:
            problem = (
                f"a BYTES element at byte {start} claims {size} bytes; only {end - start} remain"
            )
            return BytesScan(read - 1, read, end - offset, problem)
        if keep is not None:
            keep.append(bytes(view[start : start + size]))
        offset = start + size
    return BytesScan(read, read, end - offset, "")


def serialize_bytes(values: Iterable[bytes]) -> bytes:
    """tritonclient's encoding of a BYTES tensor (row-major elements)."""
    return b"".join(_LENGTH.pack(len(v)) + v for v in values)


def deserialize_bytes(data: bytes | memoryview, count: int) -> list[bytes]:
    """The `count` elements of a serialized BYTES tensor; ValueError unless it holds exactly
    that many, well formed."""
    elements: list[bytes] = []
    scan = scan_bytes(data, count, elements)
    if scan.problem:
        raise ValueError(scan.problem)
    if not scan.matches(count):
        raise ValueError(f"{count} BYTES elements expected, the data holds {scan.held()}")
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


def to_numpy_bytes(
    data: bytes | memoryview, shape: Sequence[int]
) -> np.ndarray[Any, np.dtype[Any]]:
    """A serialized BYTES tensor of `shape` as the object array Triton's Python models
    receive; ValueError unless it holds exactly the shape's elements."""
    elements = deserialize_bytes(data, math.prod(shape))
    array = np.empty(len(elements), dtype=object)
    array[:] = elements
    return array.reshape(tuple(shape))
