"""A batch's BYTES outputs with more than one element per row go back to each request whole:
`make mutate` found no test for the per-row element count in service/batching/assemble.py."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from oip.bytes_tensor import deserialize_bytes, serialize_bytes
from oip.datatypes import BY_NAME
from service.batching.assemble import BatchOutput, plan
from service.inference.validation import RequestValidator
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
