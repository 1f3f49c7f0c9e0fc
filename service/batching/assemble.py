"""A batch as the worker runs it, without joining its requests: each input's shape padded to
the model's shape buckets, each request's rows written straight to their offset in the batch's
shared-memory input (the padding too), and each request's output rows sliced straight out of
the shared-memory output into its own tensors. One copy each way; padded rows never reach a
response."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from oip.bytes_tensor import split_bytes
from oip.datatypes import Datatype
from service.inference import calls, errors
from service.inference.calls import ROOT, CallChain
from service.inference.jobs import InferJob, InputTensor, OutputTensor
from service.model.shapes import ShapeBuckets

_NO_BUCKETS = ShapeBuckets()
_LENGTH_BYTES = 4  # an empty BYTES element: its length, zero


@dataclass(frozen=True)
class BatchInput:
    """One input of the batch: the requests' tensors in order, padded to `shape`."""

    name: str
    dtype: str  # numpy's spelling, as the worker reads it
    shape: tuple[int, ...]
    nbytes: int
    parts: tuple[InputTensor, ...]
    pad_value: float
    batched: bool  # the parts stack on the batch dimension (else there is one part)
    # Every part's rows go one after the other, then zero bytes: no variable dimension is
    # padded (BYTES: padding rows are empty elements, whose lengths are zero bytes too).
    consecutive: bool

    def write(self, buf: memoryview) -> None:
        """Fill `buf` (at least `nbytes` long) with the parts' rows and the padding."""
        if self.consecutive:
            offset = 0
            for part in self.parts:
                end = offset + len(part.data)
                buf[offset:end] = part.data
                offset = end
            if offset < self.nbytes:
                np.ndarray((self.nbytes - offset,), np.uint8, buf, offset).fill(0)
            return
        out = np.ndarray(self.shape, np.dtype(self.dtype), buf)
        out.fill(self.pad_value)
        start = 0
        for part in self.parts:
            array = np.frombuffer(part.data, out.dtype).reshape(part.shape)
            if self.batched:
                rows = part.shape[0]
                region = (slice(start, start + rows), *(slice(0, d) for d in part.shape[1:]))
                start += rows
            else:
                region = tuple(slice(0, d) for d in part.shape)
            out[region] = array


@dataclass(frozen=True)
class BatchOutput:
    """One output of the whole batch as the worker left it: a view of shared memory, valid
    only until the instance hands its slot on."""

    name: str  # the name callers see
    datatype: Datatype
    shape: tuple[int, ...]
    data: bytes | memoryview


@dataclass(frozen=True)
class Batch:
    """Requests that run together, as one execution of the engine."""

    inputs: tuple[BatchInput, ...]
    outputs: tuple[str, ...]
    rows: int  # the rows the engine runs, padding included; 0: the model does not batch
    row_counts: tuple[int, ...]  # each request's rows, in order
    chain: CallChain = ROOT  # the BLS calls its requests were made by, joined

    @property
    def formed(self) -> int:
        """The rows the requests brought (the batch size formed, before padding)."""
        return sum(self.row_counts)

    def split(self, outputs: Sequence[BatchOutput]) -> tuple[tuple[OutputTensor, ...], ...]:
        """Each request's outputs, copied out of the batch's (which may be views of shared
        memory): consecutive row ranges of every output; rows past the last request's are
        padding and stay behind."""
        if not self.rows:
            return (tuple(_copied(t, t.shape, t.data) for t in outputs),)
        for tensor in outputs:  # before any view is taken, so none outlives an error
            if not tensor.shape or tensor.shape[0] != self.rows:
                raise errors.internal(
                    f"output '{tensor.name}' has shape {list(tensor.shape)}, which does not "
                    f"start with the batch's {self.rows} rows; the model cannot be batched"
                )
        per_request: list[list[OutputTensor]] = [[] for _ in self.row_counts]
        for tensor in outputs:
            for index, (count, data) in enumerate(
                zip(self.row_counts, self._row_parts(tensor), strict=True)
            ):
                per_request[index].append(_copied(tensor, (count, *tensor.shape[1:]), data))
        return tuple(tuple(outputs) for outputs in per_request)

    def _row_parts(self, tensor: BatchOutput) -> list[bytes | memoryview]:
        """Each request's consecutive rows of one output, uncopied where they can be."""
        if tensor.datatype.name == "BYTES":
            if len(self.row_counts) == 1 and self.formed == self.rows:
                return [tensor.data]  # one request, no padding: all of it, not walked
            per_row = math.prod(tensor.shape[1:])
            return list(split_bytes(tensor.data, [n * per_row for n in self.row_counts]))
        view = memoryview(tensor.data)
        row_bytes = len(view) // self.rows
        bounds = itertools.accumulate((n * row_bytes for n in self.row_counts), initial=0)
        return [view[a:b] for a, b in itertools.pairwise(bounds)]


def _copied(tensor: BatchOutput, shape: tuple[int, ...], data: bytes | memoryview) -> OutputTensor:
    return OutputTensor(tensor.name, tensor.datatype, shape, bytes(data))


def plan(jobs: Sequence[InferJob], shapes: ShapeBuckets = _NO_BUCKETS) -> Batch:
    """The batch the jobs make (they share a queue bucket: same non-batch shapes after
    padding, same outputs), padded to the buckets."""
    first = jobs[0]
    formed = sum(j.batch_size for j in jobs)
    rows = shapes.batch_rows(formed) if first.batch_size else 0
    inputs = tuple(
        _input([j.inputs[index] for j in jobs], rows, formed, shapes)
        for index in range(len(first.inputs))
    )
    chain = calls.joined(j.chain for j in jobs)
    return Batch(inputs, first.outputs, rows, tuple(j.rows for j in jobs), chain)


def _input(
    parts: Sequence[InputTensor], rows: int, formed: int, shapes: ShapeBuckets
) -> BatchInput:
    first = parts[0]
    datatype = first.datatype
    tail = first.shape[1:]
    if datatype.name == "BYTES":
        # Sequence buckets do not apply: elements have no fixed size to pad.
        padding = math.prod(tail) * (rows - formed) * _LENGTH_BYTES
        nbytes = sum(len(p.data) for p in parts) + padding
        shape = (rows, *tail) if rows else first.shape
        return BatchInput(
            first.name, datatype.numpy.str, shape, nbytes, tuple(parts), 0, bool(rows), True
        )
    shape = shapes.padded_shape(first.name, first.shape)
    if rows:
        shape = (rows, *shape[1:])
    consecutive = all(p.shape[1:] == shape[1:] for p in parts) if rows else shape == first.shape
    nbytes = math.prod(shape) * datatype.numpy.itemsize
    return BatchInput(
        first.name,
        datatype.numpy.str,
        shape,
        nbytes,
        tuple(parts),
        shapes.pad_value,
        bool(rows),
        consecutive,
    )
