"""A worker's batch gathered from the runs it took (service/workers/runs.py) holds what the
server's planner makes of the same requests one by one (`assemble.plan`): the same rows in
the same order and the same padding, whichever runs, producers and batch buckets it spans;
and each request of a run keeps its own id, times and rows."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from oip.datatypes import BY_NAME
from service.batching.assemble import plan
from service.model.shapes import ShapeBuckets
from service.queues import records
from service.workers.runs import Member, Source, gathered

PROFILE = settings(max_examples=150, deadline=None, derandomize=True, database=None)
INPUTS = [("a", BY_NAME["FP32"]), ("b", BY_NAME["INT64"]), ("c", BY_NAME["INT32"])]
WIDTHS = (3, 2, 0)  # each input's values per row (an empty dimension too)
OUTPUTS = ("out",)


def run(seed: int, count: int, rows: int, first_id: int) -> records.Run:
    """`count` requests of `rows` rows each, their values numbered from `seed`."""
    inputs = []
    for position, ((_, datatype), width) in enumerate(zip(INPUTS, WIDTHS, strict=True)):
        values = np.arange(seed, seed + count * rows * width).astype(datatype.numpy)
        inputs.append(records.RunInput(position, (rows, width), values.tobytes()))
    ids = list(range(first_id, first_id + count))
    return records.Run(ids, [None] * count, [None] * count, 0, 1, rows, (0,), tuple(inputs))


def planned(members: list[Member], shapes: ShapeBuckets) -> dict[str, np.ndarray]:
    batch = plan([member.job for member in members], shapes)
    arrays = {}
    for tensor in batch.inputs:
        buf = bytearray(tensor.nbytes)
        tensor.write(memoryview(buf))
        arrays[tensor.name] = np.frombuffer(buf, tensor.dtype).reshape(tensor.shape)
    return arrays


@PROFILE
@given(
    runs=st.lists(
        st.tuples(st.integers(1, 6), st.integers(1, 3), st.integers(0, 1)), min_size=1, max_size=4
    ),
    buckets=st.sampled_from([(), (1, 2, 4, 8, 16, 32, 64)]),
    data=st.data(),
)
def test_a_gathered_batch_is_what_the_planner_makes_of_its_requests(
    runs: list[tuple[int, int, int]], buckets: tuple[int, ...], data: st.DataObject
) -> None:
    shapes = ShapeBuckets(batch=buckets)
    members: list[Member] = []
    first_id = 0
    for number, (count, rows, key) in enumerate(runs):
        taken = run(1000 * number, count, rows, first_id)
        source = Source(key, taken, INPUTS, OUTPUTS, shapes)
        members += [Member(source, index, 0.0) for index in range(count)]
        first_id += count
    batch = [m for m in members if data.draw(st.booleans())] or members[:1]
    assert len({m.bucket for m in batch}) == 1  # one form's requests: one bucket
    rows = shapes.batch_rows(sum(m.rows for m in batch))
    mine = gathered(batch, rows)
    theirs = planned(batch, shapes)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert mine[name].dtype == theirs[name].dtype
        assert np.array_equal(mine[name], theirs[name])
    for member in batch:
        assert member.ticket == (member.source.key, member.source.run.ids[member.index], (0,))
        assert member.rows == member.source.run.batch_size
