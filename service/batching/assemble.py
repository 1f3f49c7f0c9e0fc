"""Join the requests of a batch into one job (one tensor per input, rows concatenated), padded
to the model's shape buckets, and split the batch's outputs back into each request's rows:
padded rows never reach a response."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from service import errors
from service.batching.shapes import ShapeBuckets
from service.tensors import is_bytes
from service.validation import InferJob, InputTensor
from service.workers.instance import InferResult, OutputTensor
from transport.bytes_tensor import serialize_bytes, split_bytes

_NO_BUCKETS = ShapeBuckets()


def join(jobs: Sequence[InferJob], shapes: ShapeBuckets = _NO_BUCKETS) -> InferJob:
    first = jobs[0]
    real_rows = sum(j.batch_size for j in jobs)
    rows = shapes.batch_rows(real_rows) if first.batch_size else 0
    inputs = []
    for index, tensor in enumerate(first.inputs):
        parts = [j.inputs[index] for j in jobs]
        if is_bytes(tensor.datatype.numpy):
            inputs.append(_joined_bytes(parts, rows - real_rows))
            continue
        shape = shapes.padded_shape(tensor.name, tensor.shape)
        if rows:
            shape = (rows, *shape[1:])
        if len(parts) == 1 and shape == tensor.shape:
            inputs.append(tensor)
        elif rows and all(p.shape[1:] == shape[1:] for p in parts):
            pad = bytes(len(tensor.data) // tensor.shape[0] * (rows - real_rows))
            data = b"".join(p.data for p in parts) + pad
            inputs.append(InputTensor(tensor.name, tensor.datatype, shape, data))
        else:
            inputs.append(_padded(parts, shape, shapes.pad_value, bool(rows)))
    return InferJob(tuple(inputs), first.outputs, rows)


def _joined_bytes(parts: Sequence[InputTensor], pad_rows: int) -> InputTensor:
    """BYTES rows concatenated; padding rows are empty elements (sequence buckets do not
    apply: elements have no fixed size to pad)."""
    first = parts[0]
    if len(parts) == 1 and pad_rows == 0:
        return first
    per_row = math.prod(first.shape[1:])
    rows = sum(p.shape[0] for p in parts) + pad_rows
    data = b"".join(p.data for p in parts) + serialize_bytes([b""] * (per_row * pad_rows))
    return InputTensor(first.name, first.datatype, (rows, *first.shape[1:]), data)


def _padded(
    parts: Sequence[InputTensor], shape: tuple[int, ...], value: float, batched: bool
) -> InputTensor:
    """The parts stacked on the batch dimension, each one's variable dimensions padded."""
    first = parts[0]
    dtype = first.datatype.numpy
    out = np.full(shape, value, dtype)
    start = 0
    for part in parts:
        array = np.frombuffer(part.data, dtype).reshape(part.shape)
        if batched:
            region = (slice(start, start + part.shape[0]), *(slice(0, d) for d in part.shape[1:]))
            start += part.shape[0]
        else:
            region = tuple(slice(0, d) for d in part.shape)
        out[region] = array
    return InputTensor(first.name, first.datatype, shape, out.tobytes())


def split(
    result: InferResult, row_counts: Sequence[int], rows: int | None = None
) -> list[tuple[OutputTensor, ...]]:
    """Each request's outputs: consecutive row ranges of every batched output. `rows`: the
    rows the batch ran with, padding included (default: the requests' rows)."""
    total = sum(row_counts) if rows is None else rows
    if len(row_counts) == 1 and total == row_counts[0]:
        return [result.outputs]
    per_request: list[list[OutputTensor]] = [[] for _ in row_counts]
    for tensor in result.outputs:
        if not tensor.shape or tensor.shape[0] != total:
            raise errors.internal(
                f"output '{tensor.name}' has shape {list(tensor.shape)}, which does not start "
                f"with the batch's {total} rows; the model cannot be batched"
            )
        for index, (count, data) in enumerate(
            zip(row_counts, _row_parts(tensor, row_counts, total), strict=True)
        ):
            per_request[index].append(
                OutputTensor(tensor.name, tensor.dtype, (count, *tensor.shape[1:]), data)
            )
    return [tuple(outputs) for outputs in per_request]


def _row_parts(tensor: OutputTensor, row_counts: Sequence[int], total: int) -> list[bytes]:
    """Each request's consecutive rows of one output (rows past theirs are padding)."""
    if is_bytes(tensor.dtype):
        per_row = math.prod(tensor.shape[1:])
        return split_bytes(tensor.data, [count * per_row for count in row_counts])
    row_bytes = len(tensor.data) // total
    bounds = list(itertools.accumulate((count * row_bytes for count in row_counts), initial=0))
    return [tensor.data[a:b] for a, b in itertools.pairwise(bounds)]
