"""Join the requests of a batch into one job (one tensor per input, rows concatenated) and
split the batch's outputs back into each request's rows."""

from __future__ import annotations

from collections.abc import Sequence

from service import errors
from service.validation import InferJob, InputTensor
from service.workers.instance import InferResult, OutputTensor


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
        row_bytes = len(tensor.data) // total
        start = 0
        for index, rows in enumerate(row_counts):
            end = start + rows * row_bytes
            per_request[index].append(
                OutputTensor(
                    tensor.name, tensor.dtype, (rows, *tensor.shape[1:]), tensor.data[start:end]
                )
            )
            start = end
    return [tuple(outputs) for outputs in per_request]
