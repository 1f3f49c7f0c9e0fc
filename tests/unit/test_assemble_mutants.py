"""What `make mutate` found no test for in service/batching/assemble.py: BYTES outputs with
more than one element per row go back to each request whole, and padded inputs hold the pad
value (batched or not)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from oip.bytes_tensor import deserialize_bytes, serialize_bytes
from oip.datatypes import BY_NAME
from service.batching.assemble import BatchOutput, plan
from service.inference.jobs import InferJob, InputTensor, OutputTensor
from service.inference.validation import RequestValidator
from service.model.shapes import ShapeBuckets
from tests.unit.test_batching import FP32, written
from tests.unit.test_bytes_tensors import TEXT, request_with


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    rows=st.lists(st.integers(1, 2), min_size=2, max_size=2),
    row_shape=st.sampled_from([(2,), (2, 3), (1, 4), (3, 1, 2)]),
)
def test_each_request_gets_its_own_elements_of_a_multi_element_row(
    rows: list[int], row_shape: tuple[int, ...]
) -> None:
    validator = RequestValidator(TEXT)
    jobs = [validator.validate(request_with(typed=[b"x"] * 2 * n, rows=n)) for n in rows]
    batch = plan(jobs)
    per_row = math.prod(row_shape)
    elements = [b"e%d" % i for i in range(batch.rows * per_row)]
    output = BatchOutput(
        "label", BY_NAME["BYTES"], (batch.rows, *row_shape), serialize_bytes(elements)
    )
    parts = batch.split([output])
    got = [deserialize_bytes(p[0].data, math.prod(p[0].shape)) for p in parts]
    first = rows[0] * per_row
    assert got == [elements[:first], elements[first : first + rows[1] * per_row]]
    assert [p[0].shape for p in parts] == [(n, *row_shape) for n in rows]


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(lengths=st.lists(st.integers(5, 8), min_size=1, max_size=3), batched=st.booleans())
def test_inputs_padded_to_a_sequence_bucket_hold_the_pad_value(
    lengths: list[int], batched: bool
) -> None:
    """Rows shorter than their bucket (8: they share it, as a queue's batch does) are padded
    with `pad_value`, never left as zeros; a model that does not batch pads the same way."""
    if not batched:
        lengths = lengths[:1]
    buckets = ShapeBuckets(sequence=(4, 8), pad_value=-1.0, variable=(("x", (1,)),))
    jobs = [
        InferJob(
            (InputTensor("x", FP32, (1, n), np.arange(n, dtype=np.float32).tobytes()),),
            ("y",),
            1 if batched else 0,
        )
        for n in lengths
    ]
    batch = plan(jobs, buckets)
    expected = np.full((len(jobs), 8), -1.0, np.float32)
    for row, n in enumerate(lengths):
        expected[row, :n] = np.arange(n)
    assert written(batch) == [expected.tobytes()]


def test_a_model_that_does_not_batch_gets_its_outputs_whole_and_copied() -> None:
    data = np.arange(6, dtype=np.float32).tobytes()
    job = InferJob((InputTensor("x", FP32, (1, 6), data),), ("y",), 0)
    batch = plan([job])
    shared = bytearray(data)  # stands in for the worker's shared memory
    ((output,),) = batch.split([BatchOutput("y", FP32, (2, 3), memoryview(shared))])
    shared[:] = bytes(len(shared))  # the slot is handed on
    assert output == OutputTensor("y", FP32, (2, 3), data)
