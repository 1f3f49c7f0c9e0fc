"""The records of an instance's queues (service/queues/records.py): a request and a cancel
come out of the request ring as they were written, an answer or a failure comes back as the
worker wrote it, and a reply that lies about what its request asked for (a worker runs model
code) is refused with Corrupt, whatever its bytes: nothing else escapes read_reply."""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.inference.jobs import Timings
from service.queues import records
from service.queues.layout import QueueLayout
from service.queues.records import MAX_DIM, MAX_FAILURE_TEXT, MAX_RANK, Cancel, Expected, Request
from service.queues.ring import Corrupt, RingReader, RingWriter

PROFILE = settings(max_examples=200, deadline=None, derandomize=True, database=None)
MAX_NS = 3600 * 10**9  # the most a worker's timing may say (longer ones are clamped)
U64 = 2**64 - 1
KIND, CODE, OUTPUTS, ROWS = 0, 1, 2, 4  # where a reply's fields are
REPLY_HEAD = 56  # then its outputs: index, rank, 0, nbytes (16 bytes), dims, data


def request_ring(request_bytes: int = 1 << 16) -> tuple[RingWriter, RingReader]:
    """The request ring of one segment, from the end of each process."""
    layout = QueueLayout(request_bytes=request_bytes, reply_bytes=1024, running_slots=4)
    buf = memoryview(bytearray(layout.size))
    return layout.caller_end(buf)[0], layout.worker_end(buf)[0]


def taken(reader: RingReader) -> bytes:
    payload = reader.take()
    assert payload is not None
    return payload


# ---- requests and cancels ----

times = st.none() | st.floats(allow_nan=False)
shapes = st.lists(st.integers(0, MAX_DIM), max_size=MAX_RANK).map(tuple)
inputs = st.lists(st.tuples(st.integers(0, 0xFFFF), shapes, st.binary(max_size=40)), max_size=5)


@PROFILE
@given(
    request_id=st.integers(0, U64),
    flags=st.integers(0, 0xFF),
    priority=st.integers(0, 0xFFFF),
    rows=st.integers(0, 2**32 - 1),
    expires=times,
    deadline=times,
    outputs=st.lists(st.integers(0, 0xFFFF), max_size=7),
    tensors=inputs,
)
def test_a_request_comes_out_of_the_ring_as_it_was_written(
    request_id: int,
    flags: int,
    priority: int,
    rows: int,
    expires: float | None,
    deadline: float | None,
    outputs: list[int],
    tensors: list[tuple[int, tuple[int, ...], bytes]],
) -> None:
    writer, reader = request_ring()
    assert records.write_request(
        writer, request_id, tensors, outputs, priority, rows, expires, deadline, flags
    )
    record = records.read_request(taken(reader))
    assert isinstance(record, Request)
    assert (record.id, record.flags, record.priority, record.batch_size) == (
        request_id,
        flags,
        priority,
        rows,
    )
    assert (record.expires, record.deadline) == (expires, deadline)
    assert record.outputs == tuple(outputs)
    assert [(t.position, t.shape, bytes(t.data)) for t in record.inputs] == tensors


@PROFILE
@given(request_id=st.integers(0, U64))
def test_a_cancel_comes_out_of_the_ring_as_it_was_written(request_id: int) -> None:
    writer, reader = request_ring()
    assert records.write_cancel(writer, request_id)
    assert records.read_request(taken(reader)) == Cancel(request_id)


def test_a_full_ring_takes_no_request_and_writes_nothing_of_it() -> None:
    """96 bytes a request with its length: two fill 192 of 256, a third would need the 64
    left at the end and 96 more at the start."""
    writer, reader = request_ring(request_bytes=256)
    one = [(0, (2,), bytes(range(16)))]
    assert records.write_request(writer, 0, one, [0], 0, 2, None, None)
    assert records.write_request(writer, 1, one, [0], 0, 2, None, None)
    assert not records.write_request(writer, 2, one, [0], 0, 2, None, None)
    assert [records.read_request(taken(reader)).id for _ in range(2)] == [0, 1]
    assert reader.take() is None
    assert records.write_request(writer, 3, one, [0], 0, 2, None, None)
    assert records.read_request(taken(reader)).id == 3


# ---- replies ----

ITEMSIZES = (4, 1, 8)  # of the setup's outputs 0, 1 and 2
EXPECTED = Expected(outputs=(0, 2), itemsizes=ITEMSIZES, rows=2, max_batch_rows=8)
TIMINGS = Timings(1, 2, 3)


def answer(
    outputs: list[tuple[int, tuple[int, ...], bytes]],
    batch_rows: int = 4,
    request_id: int = 7,
    timings: Timings = TIMINGS,
    queue_ns: int = 4,
) -> bytes:
    buf = bytearray(records.reply_size([(shape, len(data)) for _, shape, data in outputs]))
    records.write_answer(memoryview(buf), request_id, 3, batch_rows, timings, queue_ns, outputs)
    return bytes(buf)


OUT0 = (0, (2, 3), bytes(range(24)))  # 2 x 3 of 4 bytes
OUT2 = (2, (2,), bytes(range(100, 116)))  # 2 of 8 bytes
GOOD = answer([OUT0, OUT2])


def patched(payload: bytes, at: int, fmt: str, value: int) -> bytes:
    buf = bytearray(payload)
    struct.pack_into(fmt, buf, at, value)
    return bytes(buf)


def test_an_answer_comes_back_as_the_worker_wrote_it() -> None:
    reply = records.read_reply(GOOD, EXPECTED)
    assert (reply.id, reply.batch, reply.batch_rows, reply.timings, reply.queue_ns) == (
        7,
        3,
        4,
        TIMINGS,
        4,
    )
    assert reply.failure is None
    assert [(t.position, t.shape, bytes(t.data)) for t in reply.outputs] == [OUT0, OUT2]
    assert records.request_id_of(GOOD) == 7


@st.composite
def answers(draw: st.DrawFn) -> tuple[Expected, list[tuple[int, tuple[int, ...], bytes]], int]:
    """A request's expectations and an answer that meets them: its outputs in any order, each
    starting with the request's rows where the model batches."""
    itemsizes = tuple(draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=5)))
    wanted = draw(st.permutations(range(len(itemsizes))))[: draw(st.integers(0, len(itemsizes)))]
    rows = draw(st.integers(0, 8))
    max_rows = draw(st.integers(max(rows, 1), 64))
    outputs = []
    for index in draw(st.permutations(wanted)):
        rest = draw(st.lists(st.integers(0, 3), max_size=3))
        shape = (rows, *rest) if rows else tuple(rest)
        nbytes = math.prod(shape) * itemsizes[index]
        data = draw(st.binary(min_size=nbytes, max_size=nbytes))
        outputs.append((index, shape, data))
    return (
        Expected(tuple(wanted), itemsizes, rows, max_rows),
        outputs,
        draw(st.integers(1, max_rows)),
    )


@PROFILE
@given(
    case=answers(),
    request_id=st.integers(0, U64),
    timings=st.tuples(*[st.integers(0, U64)] * 4),
)
def test_any_answer_that_meets_its_request_comes_back_as_written(
    case: tuple[Expected, list[tuple[int, tuple[int, ...], bytes]], int],
    request_id: int,
    timings: tuple[int, int, int, int],
) -> None:
    expected, outputs, batch_rows = case
    payload = answer(outputs, batch_rows, request_id, Timings(*timings[:3]), timings[3])
    reply = records.read_reply(payload, expected)
    assert (reply.id, reply.batch_rows, reply.failure) == (request_id, batch_rows, None)
    assert [(t.position, t.shape, bytes(t.data)) for t in reply.outputs] == outputs
    clamped = [min(t, MAX_NS) for t in timings]
    assert (*dataclasses.astuple(reply.timings), reply.queue_ns) == tuple(clamped)


@pytest.mark.parametrize(
    "kind", [records.FAILED, records.TOO_LARGE, records.EXPIRED, records.CANCELLED]
)
def test_a_failure_comes_back_with_its_kind_and_text(kind: int) -> None:
    reply = records.read_reply(records.failure_bytes(7, kind, "no such luck"), EXPECTED)
    assert (reply.id, reply.failure, reply.text, reply.outputs) == (7, kind, "no such luck", ())


def test_a_failure_text_is_cut_at_its_bound() -> None:
    text = "é" * MAX_FAILURE_TEXT  # two bytes each
    reply = records.read_reply(records.failure_bytes(7, records.FAILED, text), EXPECTED)
    assert reply.text == "é" * (MAX_FAILURE_TEXT // 2)
    reply = records.read_reply(records.failure_bytes(7, records.FAILED, "x" + text), EXPECTED)
    assert reply.text == "x" + "é" * (MAX_FAILURE_TEXT // 2 - 1) + "\ufffd"


FAILURE = records.failure_bytes(7, records.FAILED, "broken")
LIES = {
    "kind 0": (patched(GOOD, KIND, "<B", 0), "a reply of kind 0"),
    "kind 3": (patched(GOOD, KIND, "<B", 3), "a reply of kind 3"),
    "failure of an unknown kind": (records.failure_bytes(7, 4, "x"), "a failure of kind 4"),
    "an output not asked for": (
        answer([OUT0, OUT2, (1, (2,), b"ab")]),
        r"outputs \[0, 2, 1\] for a request of \[0, 2\]",
    ),
    "an output outside the setup": (answer([OUT0, (9, (2,), b"ab")]), r"outputs \[0, 9\]"),
    "an output missing": (answer([OUT0]), r"outputs \[0\] for a request of \[0, 2\]"),
    "an output twice": (answer([OUT0, OUT0]), r"outputs \[0, 0\] for"),
    "an output twice among the rest": (answer([OUT0, OUT2, OUT0]), r"outputs \[0, 2, 0\] for"),
    "fewer bytes than shape x itemsize": (
        answer([(0, (2, 3), bytes(23)), OUT2]),
        r"an output of shape \[2, 3\] in 23 bytes",
    ),
    "more bytes than shape x itemsize": (
        answer([(0, (2, 3), bytes(32)), OUT2]),
        r"an output of shape \[2, 3\] in 32 bytes",
    ),
    "first dim not the request's rows": (
        answer([(0, (3, 2), bytes(24)), OUT2]),
        r"an output of shape \[3, 2\] for 2 rows",
    ),
    "a scalar for a batched request": (
        answer([OUT0, (2, (), bytes(8))]),
        r"an output of shape \[\] for 2 rows",
    ),
    "a batch of 0 rows": (answer([OUT0, OUT2], batch_rows=0), "a batch of 0 rows"),
    "a batch above the model's": (answer([OUT0, OUT2], batch_rows=9), "a batch of 9 rows"),
    "a batch of 2**32 - 1 rows": (answer([OUT0, OUT2], batch_rows=2**32 - 1), "a batch of"),
    "8 trailing bytes": (GOOD + bytes(8), "bytes after the reply's last output"),
    "1 trailing byte": (GOOD + bytes(1), "bytes after the reply's last output"),
    "an output cut short": (GOOD[:-8], "past the record's end"),
    "more outputs than the record holds": (
        patched(GOOD, OUTPUTS, "<H", 3),
        "past the record's end",
    ),
    "a rank above the bound": (patched(GOOD, REPLY_HEAD + 2, "<H", MAX_RANK + 1), "rank 17"),
    "a dim above the bound": (
        patched(GOOD, REPLY_HEAD + 16, "<Q", MAX_DIM + 1),
        r"a tensor of shape \[1099511627777, 3\]",
    ),
    "an output's bytes past the end": (
        patched(GOOD, REPLY_HEAD + 8, "<Q", U64),
        "past the record's end",
    ),
    "a failure text above the bound": (
        patched(
            records.failure_bytes(7, records.FAILED, "x" * MAX_FAILURE_TEXT) + b"x",
            REPLY_HEAD,
            "<I",
            MAX_FAILURE_TEXT + 1,
        ),
        "a failure text of 4001 bytes",
    ),
    "a failure text longer than its record": (FAILURE[:-1], "a failure text of 6 bytes"),
    "a failure text shorter than its record": (FAILURE + b"x", "a failure text of 6 bytes"),
    "a failure text of 2**32 - 1 bytes": (
        patched(FAILURE, REPLY_HEAD, "<I", 2**32 - 1),
        "a failure text of 4294967295 bytes",
    ),
    "no record": (b"", "a reply of 0 bytes"),
    "half a reply": (GOOD[: REPLY_HEAD - 1], "a reply of 55 bytes"),
    "a failure with no text length": (FAILURE[:REPLY_HEAD], "a failure of 56 bytes"),
    "a failure with half a text length": (FAILURE[: REPLY_HEAD + 4], "a failure of 60 bytes"),
}


@pytest.mark.parametrize(("payload", "message"), LIES.values(), ids=LIES.keys())
def test_a_reply_that_lies_is_corrupt(payload: bytes, message: str) -> None:
    with pytest.raises(Corrupt, match=message):
        records.read_reply(payload, EXPECTED)


@pytest.mark.parametrize("size", [0, 8, REPLY_HEAD - 1])
def test_a_reply_too_short_to_name_its_request_is_corrupt(size: int) -> None:
    with pytest.raises(Corrupt, match=f"a reply of {size} bytes"):
        records.request_id_of(GOOD[:size])


def check_read(payload: bytes, expected: Expected) -> None:
    """read_reply takes it or raises Corrupt, nothing else; what it takes meets `expected`."""
    try:
        reply = records.read_reply(payload, expected)
    except Corrupt:
        return
    if reply.failure is not None:
        assert reply.failure in (
            records.FAILED,
            records.TOO_LARGE,
            records.EXPIRED,
            records.CANCELLED,
        )
        assert len(reply.text) <= MAX_FAILURE_TEXT
        return
    assert sorted(t.position for t in reply.outputs) == sorted(expected.outputs)
    assert 0 < reply.batch_rows <= expected.max_batch_rows
    for tensor in reply.outputs:
        assert len(tensor.data) == math.prod(tensor.shape) * expected.itemsizes[tensor.position]
        assert not expected.rows or tensor.shape[:1] == (expected.rows,)
    assert max(*dataclasses.astuple(reply.timings), reply.queue_ns) <= MAX_NS


@PROFILE
@given(payload=st.binary(max_size=300))
def test_random_bytes_as_a_reply_are_corrupt_or_a_reply_that_meets_the_request(
    payload: bytes,
) -> None:
    check_read(payload, EXPECTED)


@PROFILE
@given(
    base=st.sampled_from([GOOD, FAILURE]),
    edits=st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(0, 255)), max_size=6),
    cut=st.integers(0, len(GOOD) + 8),
    tail=st.binary(max_size=16),
)
def test_a_scribbled_reply_is_corrupt_or_a_reply_that_meets_the_request(
    base: bytes, edits: list[tuple[int, int]], cut: int, tail: bytes
) -> None:
    """Random bytes rarely get past the first checks; a real reply with a few bytes changed,
    cut short or run on reaches the later ones."""
    buf = bytearray(base)
    for at, value in edits:
        if at < len(buf):
            buf[at] = value
    check_read(bytes(buf[:cut]) + tail, EXPECTED)
