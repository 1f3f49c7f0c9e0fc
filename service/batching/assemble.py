"""Join the requests of a batch into one job (one tensor per input, rows concatenated) and
split the batch's outputs back into each request's rows."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from service import errors
from service.tensors import is_bytes
from service.validation import InferJob, InputTensor
from service.workers.instance import InferResult, OutputTensor
from transport.bytes_tensor import split_bytes


def join(jobs: Sequence[InferJob]) -> InferJob:
    if len(jobs) == 1:
        return jobs[0]
    first = jobs[0]
    rows = sum(j.batch_size for j in jobs)
    inputs = []
    for index, tensor in enumerate(first.inputs):
        parts = [j.inputs[index] for j in jobs]
        inputs.append(
            InputTensor(
                tensor.name,
                tensor.datatype,
                (rows, *tensor.shape[1:]),
                b"".join(p.data for p in parts),
            )
        )
    return InferJob(tuple(inputs), first.outputs, rows)


def split(result: InferResult, row_counts: Sequence[int]) -> list[tuple[OutputTensor, ...]]:
    """Each request's outputs: consecutive row ranges of every batched output."""
    if len(row_counts) == 1:
        return [result.outputs]
    total = sum(row_counts)
    per_request: list[list[OutputTensor]] = [[] for _ in row_counts]
    for tensor in result.outputs:
        if not tensor.shape or tensor.shape[0] != total:
            raise errors.internal(
                f"output '{tensor.name}' has shape {list(tensor.shape)}, which does not start "
                f"with the batch's {total} rows; the model cannot be batched"
            )
        for index, (rows, data) in enumerate(
            zip(row_counts, _row_parts(tensor, row_counts, total), strict=True)
        ):
            per_request[index].append(
                OutputTensor(tensor.name, tensor.dtype, (rows, *tensor.shape[1:]), data)
            )
    return [tuple(outputs) for outputs in per_request]


def _row_parts(tensor: OutputTensor, row_counts: Sequence[int], total: int) -> list[bytes]:
    if is_bytes(tensor.dtype):
        per_row = math.prod(tensor.shape[1:])
        return split_bytes(tensor.data, [rows * per_row for rows in row_counts])
    row_bytes = len(tensor.data) // total
    bounds = list(itertools.accumulate((rows * row_bytes for rows in row_counts), initial=0))
    return [tensor.data[a:b] for a, b in itertools.pairwise(bounds)]
