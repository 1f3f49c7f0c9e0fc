"""The worker's queue entries for requests it took as runs (records.read_requests: requests
that came one after the other in one form), and a batch's inputs gathered from them.

A run's inputs are each one array of all of its requests' rows, so a batch of requests that
came together is a slice of it (no copy), and any other batch its requests' rows copied into
place as bytes, a span of consecutive requests at a time, not a tensor per request. A
request's own job (its tensors) is made only where a batch has to be planned request by
request (shapes padded to sequence buckets, a model that does not batch)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from oip.datatypes import Datatype
from service.batching.queue import Pending, bucket_key
from service.inference.jobs import InferJob, InputTensor
from service.model.shapes import ShapeBuckets
from service.queues import records

Arrays = dict[str, np.ndarray[Any, Any]]


class Source:
    """One run of one producer, as its members' batches read it."""

    def __init__(
        self,
        key: int,
        run: records.Run,
        inputs: list[tuple[str, Datatype]],
        outputs: tuple[str, ...],
        shapes: ShapeBuckets,
    ) -> None:
        self.key = key
        self.run = run
        self.names = outputs
        self.rows = max(run.batch_size, 1)
        self.inputs = [(*inputs[t.position], t) for t in run.inputs]
        self.bucket = bucket_key([(name, t.shape) for name, _, t in self.inputs], outputs, shapes)
        self._arrays: Arrays | None = None

    def job(self, index: int) -> InferJob:
        """The `index`th request's own job: its tensors, views of the run's bytes."""
        tensors = []
        for name, datatype, tensor in self.inputs:
            size = len(tensor.data) // len(self.run.ids)
            data = memoryview(tensor.data)[index * size : (index + 1) * size]
            tensors.append(InputTensor(name, datatype, tensor.shape, data))  # type: ignore[arg-type]
        run = self.run
        return InferJob(tuple(tensors), self.names, run.batch_size, run.priority)

    def arrays(self) -> Arrays:
        """Each input of the whole run (a model that batches): its requests' rows in order."""
        if self._arrays is None:
            count = len(self.run.ids)
            self._arrays = {
                name: np.frombuffer(t.data, datatype.numpy).reshape(
                    count * t.shape[0], *t.shape[1:]
                )
                for name, datatype, t in self.inputs
            }
        return self._arrays


class Member(Pending):
    """A request of a run, as the worker's BatchQueue holds it: the run's rows, bucket and
    priority, its own id and times."""

    rows = 1  # the run's: a plain attribute, read several times per request and batch

    def __init__(self, source: Source, index: int, now: float) -> None:
        # Not Pending's own __init__: the job is made from the run only if a batch needs it.
        run = source.run
        self.source = source
        self.index = index
        self.rows = source.rows
        self.arrival = now
        self.expires = run.expires[index]
        self.priority = run.priority
        self.deadline = run.deadlines[index]
        self.alone = bool(run.flags & records.ALONE)
        self.bucket = source.bucket
        self.ticket = (source.key, run.ids[index], run.outputs)
        # crashes, trace and order keep Pending's defaults (the worker requeues nothing)

    @property
    def job(self) -> InferJob:  # type: ignore[override]
        return self.source.job(self.index)


def gathered(batch: list[Member], rows: int) -> Arrays:
    """The batch's inputs (a model that batches, its requests in one bucket, no sequence
    buckets), `rows` rows each: the requests' rows in order, then zero rows of padding as
    `assemble.plan` pads. Consecutive requests of one run are one span of its rows."""
    spans: list[tuple[Source, int, int]] = []  # (run, first row, end row)
    for member in batch:
        source, start = member.source, member.index * member.source.rows
        if spans and spans[-1][0] is source and spans[-1][2] == start:
            spans[-1] = (source, spans[-1][1], start + source.rows)
        else:
            spans.append((source, start, start + source.rows))
    if len(spans) == 1 and spans[0][2] - spans[0][1] == rows:
        source, start, end = spans[0]
        return {name: array[start:end] for name, array in source.arrays().items()}
    # Copied as bytes, not as arrays of each run: a batch of many runs of one request (their
    # forms interleaved) would otherwise make an array per run. One bucket: the same inputs
    # in the same order, with the same bytes per row.
    gathered: Arrays = {}
    for index, (name, datatype, tensor) in enumerate(spans[0][0].inputs):
        row = math.prod(tensor.shape[1:]) * datatype.numpy.itemsize
        buf = bytearray(rows * row)  # zero bytes: the padding rows
        at = 0
        for source, start, end in spans:
            size = (end - start) * row
            data = memoryview(source.inputs[index][2].data)
            buf[at : at + size] = data[start * row : start * row + size]
            at += size
        gathered[name] = np.frombuffer(buf, datatype.numpy).reshape(rows, *tensor.shape[1:])
    return gathered
