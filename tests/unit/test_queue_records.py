"""The records of an instance's queues (service/queues/records.py and replies.py): a request
and a cancel come out of the request ring as they were written, an answer or a failure comes
back as the worker wrote it, and a reply that lies about what its request asked for (a worker
runs model code) is refused with Corrupt, whatever its bytes: nothing else escapes
read_reply. The answers to a batch's requests from one caller come in one record, each
output their rows together."""

from __future__ import annotations

import dataclasses
import math
import random
import struct
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oip.bytes_tensor import scan_bytes, serialize_bytes
from service.inference.jobs import Timings
from service.queues import records, replies
from service.queues.layout import QueueLayout
from service.queues.records import MAX_DIM, MAX_RANK, Cancel, Request
from service.queues.replies import MAX_FAILURE_TEXT, Expected
from service.queues.ring import Corrupt, RingReader, RingWriter

PROFILE = settings(max_examples=200, deadline=None, derandomize=True, database=None)
MAX_NS = 3600 * 10**9  # the most a worker's timing may say (longer ones are clamped)
U64 = 2**64 - 1
KIND, OUTPUTS, COUNT = 0, 2, 8  # where an answers record's fields are
ANSWERS_HEAD = 48  # then (id, queue ns) of each request, 16 bytes each, then its outputs:
GOOD_OUTPUTS = ANSWERS_HEAD + 16  # index, rank, 0, nbytes (16 bytes), dims, data
FAILURE_TEXT = 16  # a failure's text length; the text at 24


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


# A request's form: flags, priority, rows, outputs and each tensor's (index, shape, bytes).
forms = st.tuples(
    st.integers(0, 3),
    st.integers(0, 2),
    st.integers(0, 3),
    st.lists(st.integers(0, 3), max_size=3),
    st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(0, 4), max_size=3), st.integers(0, 20)),
        max_size=3,
    ),
)


@st.composite
def neighbours(draw: st.DrawFn) -> list[Any]:
    """A form and another of the same length and first fields that differs in one field
    further on: an output asked for, a tensor's index or one of its dims."""
    form = draw(forms)
    flags, priority, rows, outputs, tensors = form
    outputs, tensors = list(outputs), [(i, list(shape), n) for i, shape, n in tensors]
    other = draw(st.integers(5, 9))  # never one of forms' values
    changeable = ["output"] * bool(outputs) + ["index"] * bool(tensors)
    changeable += ["dim"] * any(shape for _, shape, _ in tensors)
    if not changeable:
        return [form]
    where = draw(st.sampled_from(changeable))
    if where == "output":
        outputs[draw(st.integers(0, len(outputs) - 1))] = other
    elif where == "index":
        at = draw(st.integers(0, len(tensors) - 1))
        tensors[at] = (other, tensors[at][1], tensors[at][2])
    else:
        at = draw(st.sampled_from([k for k, (_, shape, _) in enumerate(tensors) if shape]))
        tensors[at][1][draw(st.integers(0, len(tensors[at][1]) - 1))] = other
    return [form, (flags, priority, rows, outputs, tensors)]


@PROFILE
@given(
    data=st.data(),
    form_choices=st.lists(forms, min_size=1, max_size=3) | neighbours(),
    seed=st.integers(0, 2**32),
)
def test_requests_read_as_runs_are_the_requests_written_and_each_run_holds_all_it_can(
    data: st.DataObject, form_choices: list[Any], seed: int
) -> None:
    """Requests of a few forms and cancels, written over a ring whose bytes are garbage (the
    padding a writer skips holds whatever was there): read_requests gives back every record
    in order, each request as it was written, consecutive requests of one form in one run,
    and two runs side by side are of different forms."""
    writer, reader = request_ring(1 << 14)
    writer._data[:] = random.Random(seed).randbytes(len(writer._data))
    written: list[Any] = []
    for number in range(data.draw(st.integers(1, 12))):
        if data.draw(st.integers(0, 5)) == 0:
            assert records.write_cancel(writer, number)
            written.append(Cancel(number))
            continue
        flags, priority, rows, outputs, tensors = data.draw(st.sampled_from(form_choices))
        inputs = [
            (i, tuple(shape), data.draw(st.binary(min_size=n, max_size=n)))
            for i, shape, n in tensors
        ]
        expires, deadline = data.draw(times), data.draw(times)
        assert records.write_request(
            writer, number, inputs, outputs, priority, rows, expires, deadline, flags
        )
        form = (
            flags,
            priority,
            rows,
            tuple(outputs),
            [(i, shape, len(d)) for i, shape, d in inputs],
        )
        written.append((number, expires, deadline, form, [d for _, _, d in inputs]))
    read: list[Any] = []
    forms_read: list[Any] = []
    for record in records.read_requests(reader.take_all()):
        if isinstance(record, Cancel):
            read.append(record)
            forms_read.append(None)
            continue
        count = len(record.ids)
        assert count == len(record.expires) == len(record.deadlines) >= 1
        form = (
            record.flags,
            record.priority,
            record.batch_size,
            record.outputs,
            [(t.position, t.shape, len(t.data) // count) for t in record.inputs],
        )
        assert all(len(t.data) % count == 0 for t in record.inputs)
        if forms_read and forms_read[-1] is not None:
            assert forms_read[-1] != form  # else the two would be one run
        forms_read.append(form)
        for index in range(count):
            own = [
                bytes(t.data[index * len(t.data) // count : (index + 1) * len(t.data) // count])
                for t in record.inputs
            ]
            read.append(
                (record.ids[index], record.expires[index], record.deadlines[index], form, own)
            )
    assert read == written


# ---- replies ----

ITEMSIZES = (4, 1, 8)  # of the setup's outputs 0, 1 and 2
EXPECTED = Expected(outputs=(0, 2), itemsizes=ITEMSIZES, rows=2, max_batch_rows=8)
TIMINGS = Timings(1, 2, 3)
Output = tuple[int, tuple[int, ...], bytes]


def answers(
    outputs: list[Output],
    batch_rows: int = 4,
    answered: Sequence[tuple[int, int]] = ((7, 4),),
    timings: Timings = TIMINGS,
    counts_batch: bool = True,
) -> bytes:
    size = replies.answers_size(len(answered), [(shape, len(data)) for _, shape, data in outputs])
    buf = bytearray(size)
    replies.write_answers(
        memoryview(buf), 3, batch_rows, timings, counts_batch, answered, outputs
    )  # fmt: skip
    return bytes(buf)


def sent(*expected: tuple[int, Expected]) -> Callable[[int], Expected | None]:
    """What the reader sent: each request's id and expectations."""
    return dict(expected).get


SENT = sent((7, EXPECTED))
OUT0 = (0, (2, 3), bytes(range(24)))  # 2 x 3 of 4 bytes
OUT2 = (2, (2,), bytes(range(100, 116)))  # 2 of 8 bytes
GOOD = answers([OUT0, OUT2])


def patched(payload: bytes, at: int, fmt: str, value: int) -> bytes:
    buf = bytearray(payload)
    struct.pack_into(fmt, buf, at, value)
    return bytes(buf)


def test_an_answer_comes_back_as_the_worker_wrote_it() -> None:
    (reply,) = replies.read_reply(GOOD, SENT)
    assert (reply.id, reply.batch, reply.batch_rows, reply.timings, reply.queue_ns) == (
        7,
        3,
        4,
        TIMINGS,
        4,
    )
    assert (reply.failure, reply.counts_batch) == (None, True)
    assert [(t.position, t.shape, bytes(t.data)) for t in reply.outputs] == [OUT0, OUT2]


def test_the_answers_to_several_requests_are_split_by_their_rows() -> None:
    """Requests of 1, 3 and 2 rows: each gets its own rows of each output, in order, and
    only the record's first counts the batch."""
    rows = {5: 1, 9: 3, 6: 2}
    expected = {i: Expected((2, 0), ITEMSIZES, n, 8) for i, n in rows.items()}
    out0 = (0, (6, 2), bytes(range(48)))
    out2 = (2, (6,), bytes(range(100, 148)))
    payload = answers([out2, out0], 6, [(5, 10), (9, 11), (6, 12)])
    answers_read = replies.read_reply(payload, expected.get)
    assert [(r.id, r.queue_ns, r.counts_batch) for r in answers_read] == [
        (5, 10, True),
        (9, 11, False),
        (6, 12, False),
    ]
    got = [[(t.position, t.shape, bytes(t.data)) for t in r.outputs] for r in answers_read]
    assert got == [
        [(2, (1,), bytes(range(100, 108))), (0, (1, 2), bytes(range(8)))],
        [(2, (3,), bytes(range(108, 132))), (0, (3, 2), bytes(range(8, 32)))],
        [(2, (2,), bytes(range(132, 148))), (0, (2, 2), bytes(range(32, 48)))],
    ]


@st.composite
def batches(draw: st.DrawFn) -> tuple[dict[int, Expected], list[Output], list[list[Output]], int]:
    """Requests that asked for the same outputs, and an answers record that meets them: its
    outputs in any order, each their rows together where the model batches (one request
    where it does not); and each request's own part of each output. An itemsize of 0: a
    BYTES output, its elements serialized (each request's part: its rows' elements)."""
    itemsizes = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 4, 8]), min_size=1, max_size=5)))
    wanted = draw(st.permutations(range(len(itemsizes))))[: draw(st.integers(0, len(itemsizes)))]
    max_rows = draw(st.integers(1, 64))
    batching = draw(st.booleans())
    counts = draw(st.lists(st.integers(1, 4), min_size=1, max_size=6)) if batching else [0]
    max_rows = max(max_rows, sum(counts))
    ids = draw(
        st.lists(st.integers(0, U64), min_size=len(counts), max_size=len(counts), unique=True)
    )
    expected = {
        i: Expected(tuple(wanted), itemsizes, n, max_rows) for i, n in zip(ids, counts, strict=True)
    }
    outputs: list[Output] = []
    mine: list[list[Output]] = [[] for _ in counts]
    for index in draw(st.permutations(wanted)):
        rest = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        row = math.prod(rest) * itemsizes[index]
        shape = (sum(counts), *rest) if batching else rest
        elements = math.prod(shape)
        if itemsizes[index]:
            nbytes = elements * itemsizes[index]
            data = draw(st.binary(min_size=nbytes, max_size=nbytes))
        else:
            values = draw(st.lists(st.binary(max_size=5), min_size=elements, max_size=elements))
            data = serialize_bytes(values)
        outputs.append((index, shape, data))
        start = 0
        for place, count in enumerate(counts):
            if not batching:
                mine[place].append((index, shape, data))
            elif itemsizes[index]:
                mine[place].append(
                    (index, (count, *rest), data[start * row : (start + count) * row])
                )
            else:
                per_row = math.prod(rest)
                own = values[start * per_row : (start + count) * per_row]
                mine[place].append((index, (count, *rest), serialize_bytes(own)))
            start += count
    return expected, outputs, mine, draw(st.integers(1, max_rows))


@PROFILE
@given(
    case=batches(),
    queued=st.lists(st.integers(0, U64), min_size=6, max_size=6),
    timings=st.tuples(*[st.integers(0, U64)] * 3),
)
def test_any_answers_that_meet_their_requests_come_back_as_written(
    case: tuple[dict[int, Expected], list[Output], list[list[Output]], int],
    queued: list[int],
    timings: tuple[int, int, int],
) -> None:
    expected, outputs, mine, batch_rows = case
    answered = list(zip(expected, queued, strict=False))  # 6 ids at most
    payload = answers(outputs, batch_rows, answered, Timings(*timings))
    answers_read = replies.read_reply(payload, expected.get)
    assert [(r.id, r.batch_rows, r.failure) for r in answers_read] == [
        (i, batch_rows, None) for i in expected
    ]
    for reply, own, (_, queue_ns) in zip(answers_read, mine, answered, strict=True):
        assert [(t.position, t.shape, bytes(t.data)) for t in reply.outputs] == own
        clamped = [min(t, MAX_NS) for t in (*timings, queue_ns)]
        assert (*dataclasses.astuple(reply.timings), reply.queue_ns) == tuple(clamped)


@pytest.mark.parametrize(
    "kind", [replies.FAILED, replies.TOO_LARGE, replies.EXPIRED, replies.CANCELLED]
)
def test_a_failure_comes_back_with_its_kind_and_text(kind: int) -> None:
    (reply,) = replies.read_reply(replies.failure_bytes(7, kind, "no such luck"), SENT)
    assert (reply.id, reply.failure, reply.text, reply.outputs) == (7, kind, "no such luck", ())


def test_a_failure_text_is_cut_at_its_bound() -> None:
    text = "é" * MAX_FAILURE_TEXT  # two bytes each
    (reply,) = replies.read_reply(replies.failure_bytes(7, replies.FAILED, text), SENT)
    assert reply.text == "é" * (MAX_FAILURE_TEXT // 2)
    (reply,) = replies.read_reply(replies.failure_bytes(7, replies.FAILED, "x" + text), SENT)
    assert reply.text == "x" + "é" * (MAX_FAILURE_TEXT // 2 - 1) + "\ufffd"


FAILURE = replies.failure_bytes(7, replies.FAILED, "broken")
TWO_ROWS = Expected(outputs=(0, 2), itemsizes=ITEMSIZES, rows=2, max_batch_rows=8)
NINE = sent(*[(i, Expected((0,), ITEMSIZES, 1, 8)) for i in range(9)])
LIES: dict[str, tuple[bytes, str] | tuple[bytes, str, Callable[[int], Expected | None]]] = {
    "kind 0": (patched(GOOD, KIND, "<B", 0), "a reply of kind 0"),
    "kind 3": (patched(GOOD, KIND, "<B", 3), "a reply of kind 3"),
    "failure of an unknown kind": (replies.failure_bytes(7, 4, "x"), "a failure of kind 4"),
    "an answer to a request not sent": (
        answers([OUT0, OUT2], answered=[(8, 0)]),
        "a reply to request 8, which it was not sent",
    ),
    "a failure of a request not sent": (
        replies.failure_bytes(8, replies.FAILED, "x"),
        "a reply to request 8, which it was not sent",
    ),
    "answers to one request twice": (
        answers([(0, (4, 3), bytes(48)), (2, (4,), bytes(32))], answered=[(7, 0), (7, 0)]),
        "answers to one request twice",
    ),
    "answers to 0 requests": (patched(GOOD, COUNT, "<Q", 0), "answers to 0 requests"),
    "answers to 2**64 - 1 requests": (
        patched(GOOD, COUNT, "<Q", U64),
        "answers to 18446744073709551615 requests in a record of",
    ),
    "more answers than the model's batch": (
        answers([(0, (9, 3), bytes(108))], answered=[(i, 0) for i in range(9)]),
        "answers to 9 requests in one record",
        NINE,
    ),
    "two answers where the model does not batch": (
        answers([(0, (3,), bytes(12))], answered=[(1, 0), (2, 0)]),
        "answers to 2 requests in one record",
        sent(*[(i, Expected((0,), ITEMSIZES, 0, 1)) for i in (1, 2)]),
    ),
    "answers to requests of different outputs": (
        answers([(0, (2, 3), bytes(24))], answered=[(1, 0), (2, 0)]),
        "answers to requests of different outputs in one record",
        sent((1, Expected((0,), ITEMSIZES, 1, 8)), (2, Expected((0, 2), ITEMSIZES, 1, 8))),
    ),
    "rows that are not the requests' together": (
        answers([(0, (3, 3), bytes(36)), (2, (3,), bytes(24))], answered=[(1, 0), (2, 0)]),
        r"an output of shape \[3, 3\] for 4 rows",
        sent((1, TWO_ROWS), (2, TWO_ROWS)),
    ),
    "an output not asked for": (
        answers([OUT0, OUT2, (1, (2,), b"ab")]),
        r"outputs \[0, 2, 1\] for a request of \[0, 2\]",
    ),
    "an output outside the setup": (answers([OUT0, (9, (2,), b"ab")]), r"outputs \[0, 9\]"),
    "an output missing": (answers([OUT0]), r"outputs \[0\] for a request of \[0, 2\]"),
    "an output twice": (answers([OUT0, OUT0]), r"outputs \[0, 0\] for"),
    "an output twice among the rest": (answers([OUT0, OUT2, OUT0]), r"outputs \[0, 2, 0\] for"),
    "fewer bytes than shape x itemsize": (
        answers([(0, (2, 3), bytes(23)), OUT2]),
        r"an output of shape \[2, 3\] in 23 bytes",
    ),
    "more bytes than shape x itemsize": (
        answers([(0, (2, 3), bytes(32)), OUT2]),
        r"an output of shape \[2, 3\] in 32 bytes",
    ),
    "first dim not the request's rows": (
        answers([(0, (3, 2), bytes(24)), OUT2]),
        r"an output of shape \[3, 2\] for 2 rows",
    ),
    "a scalar for a batched request": (
        answers([OUT0, (2, (), bytes(8))]),
        r"an output of shape \[\] for 2 rows",
    ),
    "a batch of 0 rows": (answers([OUT0, OUT2], batch_rows=0), "a batch of 0 rows"),
    "a batch above the model's": (answers([OUT0, OUT2], batch_rows=9), "a batch of 9 rows"),
    "a batch of 2**32 - 1 rows": (answers([OUT0, OUT2], batch_rows=2**32 - 1), "a batch of"),
    "8 trailing bytes": (GOOD + bytes(8), "bytes after the reply's last output"),
    "1 trailing byte": (GOOD + bytes(1), "bytes after the reply's last output"),
    "an output cut short": (GOOD[:-8], "past the record's end"),
    "more outputs than the record holds": (
        patched(GOOD, OUTPUTS, "<H", 3),
        "past the record's end",
    ),
    "a rank above the bound": (patched(GOOD, GOOD_OUTPUTS + 2, "<H", MAX_RANK + 1), "rank 17"),
    "a dim above the bound": (
        patched(GOOD, GOOD_OUTPUTS + 16, "<Q", MAX_DIM + 1),
        r"a tensor of shape \[1099511627777, 3\]",
    ),
    "an output's bytes past the end": (
        patched(GOOD, GOOD_OUTPUTS + 8, "<Q", U64),
        "past the record's end",
    ),
    "a failure text above the bound": (
        patched(
            replies.failure_bytes(7, replies.FAILED, "x" * MAX_FAILURE_TEXT) + b"x",
            FAILURE_TEXT,
            "<I",
            MAX_FAILURE_TEXT + 1,
        ),
        f"a failure text of {MAX_FAILURE_TEXT + 1} bytes",
    ),
    "a failure text longer than its record": (FAILURE[:-1], "a failure text of 6 bytes"),
    "a failure text shorter than its record": (FAILURE + b"x", "a failure text of 6 bytes"),
    "a failure text of 2**32 - 1 bytes": (
        patched(FAILURE, FAILURE_TEXT, "<I", 2**32 - 1),
        "a failure text of 4294967295 bytes",
    ),
    "no record": (b"", "a reply of 0 bytes"),
    "half a head": (GOOD[: ANSWERS_HEAD - 1], "a reply of 47 bytes"),
    "a head without its answers": (GOOD[: GOOD_OUTPUTS - 1], "answers to 1 requests in a record"),
    "a failure with no text length": (FAILURE[:FAILURE_TEXT], "a failure of 16 bytes"),
    "a failure with half a text length": (FAILURE[: FAILURE_TEXT + 4], "a failure of 20 bytes"),
}


@pytest.mark.parametrize("lie", LIES.values(), ids=LIES.keys())
def test_a_reply_that_lies_is_corrupt(
    lie: tuple[bytes, str] | tuple[bytes, str, Callable[[int], Expected | None]],
) -> None:
    payload, message, *reader = lie
    with pytest.raises(Corrupt, match=message):
        replies.read_reply(payload, reader[0] if reader else SENT)


def check_read(payload: bytes, expected_of: Callable[[int], Expected | None]) -> None:
    """read_reply takes it or raises Corrupt, nothing else; what it takes meets what each
    request expects."""
    try:
        answers_read = replies.read_reply(payload, expected_of)
    except Corrupt:
        return
    assert len({r.id for r in answers_read}) == len(answers_read) > 0
    assert sum(r.counts_batch for r in answers_read) <= 1
    for reply in answers_read:
        expected = expected_of(reply.id)
        assert expected is not None
        if reply.failure is not None:
            assert len(answers_read) == 1
            assert reply.failure in (
                replies.FAILED,
                replies.TOO_LARGE,
                replies.EXPIRED,
                replies.CANCELLED,
            )
            assert len(reply.text) <= MAX_FAILURE_TEXT
            continue
        assert sorted(t.position for t in reply.outputs) == sorted(expected.outputs)
        assert 0 < reply.batch_rows <= expected.max_batch_rows
        for tensor in reply.outputs:
            elements = math.prod(tensor.shape)
            if expected.itemsizes[tensor.position]:
                assert len(tensor.data) == elements * expected.itemsizes[tensor.position]
            else:
                assert scan_bytes(tensor.data, elements).matches(elements)
            assert not expected.rows or tensor.shape[:1] == (expected.rows,)
        assert max(*dataclasses.astuple(reply.timings), reply.queue_ns) <= MAX_NS


# Any of ids 0-7 may be read as sent: random bytes can name them.
MANY = sent(*[(i, Expected((0, 2), ITEMSIZES, 1 + i % 2, 8)) for i in range(8)])


@PROFILE
@given(payload=st.binary(max_size=300))
def test_random_bytes_as_a_reply_are_corrupt_or_replies_that_meet_their_requests(
    payload: bytes,
) -> None:
    check_read(payload, SENT)
    check_read(payload, MANY)


TWO = answers(
    [(0, (4, 3), bytes(range(48))), (2, (4,), bytes(range(32)))], 4, [(1, 0), (2, 5)]
)  # fmt: skip
# Two requests' BYTES output 1 (of 2 rows each), with output 0.
BYTES_SIZES = (4, 0, 8)
TWO_BYTES = answers(
    [(1, (4, 2), serialize_bytes([b"ab", b"", b"c", b"def"] * 2)), (0, (4,), bytes(range(16)))],
    4,
    [(1, 0), (2, 5)],
)
TWO_BYTES_SENT = sent(*[(i, Expected((1, 0), BYTES_SIZES, 2, 8)) for i in (1, 2)])


@PROFILE
@given(
    base=st.sampled_from([GOOD, FAILURE, TWO, TWO_BYTES]),
    edits=st.lists(st.tuples(st.integers(0, len(TWO_BYTES) - 1), st.integers(0, 255)), max_size=6),
    cut=st.integers(0, len(TWO_BYTES) + 8),
    tail=st.binary(max_size=16),
)
def test_a_scribbled_reply_is_corrupt_or_replies_that_meet_their_requests(
    base: bytes, edits: list[tuple[int, int]], cut: int, tail: bytes
) -> None:
    """Random bytes rarely get past the first checks; a real reply with a few bytes changed,
    cut short or run on reaches the later ones."""
    buf = bytearray(base)
    for at, value in edits:
        if at < len(buf):
            buf[at] = value
    payload = bytes(buf[:cut]) + tail
    check_read(payload, SENT)
    check_read(payload, sent((1, TWO_ROWS), (2, TWO_ROWS), (7, EXPECTED)))
    check_read(payload, TWO_BYTES_SENT)


def test_a_bytes_output_is_split_by_its_requests_rows_of_elements() -> None:
    first, second = replies.read_reply(TWO_BYTES, TWO_BYTES_SENT)
    assert [(t.position, t.shape, bytes(t.data)) for t in first.outputs] == [
        (1, (2, 2), serialize_bytes([b"ab", b"", b"c", b"def"])),
        (0, (2,), bytes(range(8))),
    ]
    assert bytes(second.outputs[0].data) == serialize_bytes([b"ab", b"", b"c", b"def"])


@pytest.mark.parametrize(
    "data",
    [
        serialize_bytes([b"a"] * 7),  # an element short
        serialize_bytes([b"a"] * 9),  # one too many
        serialize_bytes([b"a"] * 8)[:-1],  # the last cut short
        struct.pack("<I", 1 << 30) + serialize_bytes([b"a"] * 7),  # a length past the end
    ],
    ids=["short", "long", "cut", "huge length"],
)
def test_a_bytes_output_that_does_not_hold_its_elements_is_corrupt(data: bytes) -> None:
    payload = answers([(1, (4, 2), data), (0, (4,), bytes(range(16)))], 4, [(1, 0), (2, 5)])
    with pytest.raises(Corrupt, match="an output of shape"):
        replies.read_reply(payload, TWO_BYTES_SENT)
