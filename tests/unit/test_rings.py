"""The shared-memory ring (service/queues/ring.py) over a plain buffer: what a correct writer
writes comes out intact and in order, room is refused exactly when there is none, and what a
hostile other side writes into the control block or the data (a worker runs model code) is
refused with Corrupt, never read past, never an IndexError or a payload from outside the ring."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.queues.ring import (
    CONTROL_BYTES,
    WRAP,
    Corrupt,
    RingReader,
    RingWriter,
    aligned8,
    max_record,
)

PROFILE = settings(max_examples=200, deadline=None, derandomize=True, database=None)
HEAD, TAIL = 0, 64  # where each side publishes its position in the control block
PREFIX = 8  # a record's length and padding
U64 = 2**64 - 1
capacities = st.integers(4, 64).map(lambda units: 8 * units)
Take = Callable[[RingReader], object]
TAKES = [RingReader.take, RingReader.take_all]  # a hostile writer's bytes fail both alike


class Ring:
    """Both ends of one ring over a bytearray, as the two processes see the segment."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buf = bytearray(CONTROL_BYTES + capacity)
        view = memoryview(self.buf)
        control, data = view[:CONTROL_BYTES], view[CONTROL_BYTES:]
        self.writer = RingWriter(control, data)
        self.reader = RingReader(control, data)

    def put(self, payload: bytes) -> bool:
        room = self.writer.reserve(len(payload))
        if room is None:
            return False
        room[:] = payload
        room.release()
        self.writer.commit()
        return True

    def word(self, at: int) -> int:
        return int(struct.unpack_from("<Q", self.buf, at)[0])

    def set_word(self, at: int, value: int) -> None:
        struct.pack_into("<Q", self.buf, at, value)

    def set_length(self, offset: int, length: int) -> None:
        """A record's length where the writer would put it, `offset` bytes into the data."""
        struct.pack_into("<I", self.buf, CONTROL_BYTES + offset, length)

    @property
    def data(self) -> bytes:
        return bytes(self.buf[CONTROL_BYTES:])


def payload_of(number: int, size: int) -> bytes:
    """Distinct bytes per record, so a record overwritten by a later one is seen."""
    return random.Random(number).randbytes(size)


def advanced(capacity: int, sizes: list[int]) -> Ring:
    """A ring whose positions have moved on by writing and taking these records."""
    ring = Ring(capacity)
    for size in sizes:
        assert ring.put(bytes(size))
        assert ring.reader.take() == bytes(size)
    return ring


def sizes_for(capacity: int) -> st.SearchStrategy[int]:
    return st.integers(0, max_record(capacity))


# ---- a correct writer and reader ----


@PROFILE
@given(data=st.data())
def test_records_come_out_intact_in_order_and_room_is_refused_exactly_when_there_is_none(
    data: st.DataObject,
) -> None:
    """Any interleaving of writes (a size) and takes (None), checked against a model of the
    positions: a record that would cross the end of the data starts over at its beginning,
    and the writer may never hold more than `capacity` bytes ahead of the reader."""
    capacity = data.draw(capacities)
    ops = data.draw(st.lists(st.none() | sizes_for(capacity), max_size=60))
    ring = Ring(capacity)
    pending: list[bytes] = []
    head = tail = written = 0
    ends: list[int] = []  # each pending record's end position
    for op in [*ops, *[None] * len(ops)]:
        if op is None:
            taken = ring.reader.take()
            assert taken == (pending.pop(0) if pending else None)
            if taken is not None:
                tail = ends.pop(0)
            assert ring.word(TAIL) == tail
            continue
        need = PREFIX + aligned8(op)
        start = head if head % capacity + need <= capacity else head + capacity - head % capacity
        fits = start + need - tail <= capacity
        payload = payload_of(written, op)
        assert ring.put(payload) == fits
        assert ring.word(HEAD) == (start + need if fits else head)
        if fits:
            written += 1
            pending.append(payload)
            head = start + need
            ends.append(head)
            assert head - tail <= capacity
    assert not pending
    assert ring.writer.taken == ring.word(HEAD)


def test_a_record_that_would_cross_the_end_goes_to_the_start_after_a_wrap_mark() -> None:
    ring = advanced(64, [16, 16])  # positions at 48: a record of 16 needs 24, 16 are left
    assert ring.put(b"abcdefghijklmnop")
    assert struct.unpack_from("<I", ring.data, 48)[0] == WRAP
    assert struct.unpack_from("<I", ring.data, 0)[0] == 16
    assert ring.word(HEAD) == 64 + 24
    assert ring.reader.take() == b"abcdefghijklmnop"
    assert ring.word(TAIL) == 64 + 24


def test_a_writer_blocked_by_unread_bytes_gets_room_once_the_reader_takes_them() -> None:
    ring = Ring(64)
    assert ring.put(b"1" * 24)
    assert ring.put(b"2" * 24)  # 64 bytes written, none read
    assert ring.writer.reserve(0) is None
    assert ring.writer.taken == 0
    assert ring.reader.take() == b"1" * 24
    assert ring.put(b"3" * 24)
    assert ring.reader.take() == b"2" * 24
    assert ring.reader.take() == b"3" * 24
    assert ring.reader.take() is None
    assert ring.writer.taken == ring.word(HEAD)


@PROFILE
@given(data=st.data())
def test_after_draining_a_record_of_max_record_always_fits(data: st.DataObject) -> None:
    capacity = data.draw(capacities)
    ring = advanced(capacity, data.draw(st.lists(sizes_for(capacity), max_size=30)))
    payload = payload_of(0, max_record(capacity))
    assert ring.put(payload)
    assert ring.reader.take() == payload


@PROFILE
@given(data=st.data())
def test_a_record_above_max_record_is_a_value_error_and_writes_nothing(
    data: st.DataObject,
) -> None:
    capacity = data.draw(capacities)
    ring = advanced(capacity, data.draw(st.lists(sizes_for(capacity), max_size=10)))
    head = ring.word(HEAD)
    with pytest.raises(ValueError, match=f"this ring takes {max_record(capacity)}"):
        ring.writer.reserve(data.draw(st.integers(max_record(capacity) + 1, 2**32)))
    assert ring.word(HEAD) == head
    assert ring.reader.take() is None


def test_a_ring_needs_whole_8_byte_units_and_a_control_block() -> None:
    buf = memoryview(bytearray(CONTROL_BYTES + 64))
    for control, data in (
        (buf[:CONTROL_BYTES], buf[CONTROL_BYTES : CONTROL_BYTES + 60]),
        (buf[:CONTROL_BYTES], buf[CONTROL_BYTES:CONTROL_BYTES]),
        (buf[:64], buf[CONTROL_BYTES:]),
    ):
        for side in (RingWriter, RingReader):
            with pytest.raises(ValueError, match="8-byte units"):
                side(control, data)


# ---- a hostile writer, seen by the reader ----


@pytest.mark.parametrize("take", TAKES)
@PROFILE
@given(data=st.data())
def test_a_writer_position_behind_the_reader_or_more_than_capacity_ahead_is_corrupt(
    take: Take, data: st.DataObject
) -> None:
    capacity = data.draw(capacities)
    ring = advanced(capacity, data.draw(st.lists(sizes_for(capacity), min_size=1, max_size=10)))
    tail = ring.word(TAIL)
    head = data.draw(st.integers(0, tail - 1) | st.integers(tail + capacity + 1, U64))
    ring.set_word(HEAD, head)
    with pytest.raises(Corrupt, match="the writer's position"):
        take(ring.reader)
    assert ring.word(TAIL) == tail


@pytest.mark.parametrize("take", TAKES)
@pytest.mark.parametrize("length", [max_record(64) + 1, 64, WRAP - 1])
def test_a_record_longer_than_max_record_is_corrupt(take: Take, length: int) -> None:
    ring = Ring(64)
    ring.set_length(0, length)
    ring.set_word(HEAD, 64)
    with pytest.raises(Corrupt, match=f"a record of {length} bytes"):
        take(ring.reader)
    assert ring.word(TAIL) == 0


@pytest.mark.parametrize("take", TAKES)
@pytest.mark.parametrize(("length", "head"), [(1, 8), (1, 15), (8, 8), (16, 23), (24, 31)])
def test_a_record_that_runs_past_the_writer_position_is_corrupt(
    take: Take, length: int, head: int
) -> None:
    ring = Ring(64)
    ring.set_length(0, length)
    ring.set_word(HEAD, head)
    with pytest.raises(Corrupt, match=f"a record of {length} bytes where {head} are written"):
        take(ring.reader)
    assert ring.word(TAIL) == 0


@pytest.mark.parametrize("take", TAKES)
def test_a_record_that_crosses_the_end_of_the_data_is_corrupt(take: Take) -> None:
    """A correct writer wraps such a record; read as it lies, its payload would be cut short
    at the end of the data and the reader's position would land mid-record."""
    ring = advanced(64, [16, 16, 0])  # positions at 56: 8 bytes to the end
    ring.set_length(56, 16)
    ring.set_word(HEAD, 56 + PREFIX + 16)
    with pytest.raises(Corrupt, match="a record of 16 bytes across the end of the ring"):
        take(ring.reader)
    assert ring.word(TAIL) == 56


@pytest.mark.parametrize("take", TAKES)
@pytest.mark.parametrize(
    ("sizes", "head"), [([], 64), ([0], 64), ([24], 64), ([16, 16, 0], 64), ([24], 64 + 4)]
)
def test_a_wrap_mark_with_nothing_after_it_is_corrupt(
    take: Take, sizes: list[int], head: int
) -> None:
    ring = advanced(64, sizes)
    tail = ring.word(TAIL)
    ring.set_length(tail % 64, WRAP)
    ring.set_word(HEAD, head)  # the end of the data (at most a whole ring from the reader)
    with pytest.raises(Corrupt, match="a wrap with no record after it"):
        take(ring.reader)
    assert ring.word(TAIL) == tail


@PROFILE
@given(data=st.data())
def test_whatever_the_writer_scribbles_take_returns_a_bounded_payload_from_the_ring_or_corrupt(
    data: st.DataObject,
) -> None:
    """Random bytes over the data and a random head (mostly within reach, so the records are
    parsed): each take() returns None, a payload of at most max_record bytes copied from the
    data area, as long as its record says, or raises Corrupt; the reader's position never
    passes the writer's."""
    capacity = data.draw(capacities)
    ring = advanced(capacity, data.draw(st.lists(sizes_for(capacity), max_size=10)))
    tail = ring.word(TAIL)
    scribbled = data.draw(st.binary(min_size=capacity, max_size=capacity))
    ring.buf[CONTROL_BYTES:] = scribbled
    lengths = sizes_for(capacity) | st.just(WRAP) | st.integers(0, WRAP)
    for place in range(0, capacity, 8):  # lengths a writer could write, where records may start
        ring.set_length(place, data.draw(lengths))
    head = data.draw(st.integers(tail, tail + capacity) | st.integers(0, U64))
    ring.set_word(HEAD, head)
    for _ in range(capacity // 8 + 1):
        try:
            payload = ring.reader.take()
        except Corrupt:
            return
        if payload is None:
            return
        after = ring.word(TAIL)
        assert len(payload) <= max_record(capacity)
        assert tail < after <= head
        start = after - PREFIX - aligned8(len(payload))  # where its record began
        assert start in (tail, tail + capacity - tail % capacity)  # where it was, or wrapped
        assert start // capacity == (after - 1) // capacity  # not across the data's end
        offset = start % capacity
        assert struct.unpack_from("<I", ring.data, offset)[0] == len(payload)
        assert payload == ring.data[offset + PREFIX : offset + PREFIX + len(payload)]
        tail = after
    raise AssertionError("more records than a ring of this capacity holds")


@PROFILE
@given(data=st.data())
def test_take_all_returns_what_takes_one_by_one_return_or_corrupt_where_one_of_them_is(
    data: st.DataObject,
) -> None:
    """The same ring read both ways, after a correct writer's records (wrapping or not) or
    scribbles over its data and head: take_all gives every payload the takes give, in order,
    and leaves the reader where they leave it, or raises Corrupt where a take raises it."""
    capacity = data.draw(capacities)
    ring = advanced(capacity, data.draw(st.lists(sizes_for(capacity), max_size=10)))
    tail = ring.word(TAIL)
    for number, size in enumerate(data.draw(st.lists(sizes_for(capacity), max_size=10))):
        if not ring.put(payload_of(number, size)):
            break
    if data.draw(st.booleans()):  # scribbled, as the scribble test above does
        ring.buf[CONTROL_BYTES:] = data.draw(st.binary(min_size=capacity, max_size=capacity))
        near = st.integers(0, capacity)  # some past max_record, yet within the head's reach
        lengths = sizes_for(capacity) | near | st.just(WRAP) | st.integers(0, WRAP)
        for place in range(0, capacity, 8):
            ring.set_length(place, data.draw(lengths))
        ring.set_word(HEAD, data.draw(st.integers(tail, tail + capacity) | st.integers(0, U64)))
    before = bytes(ring.buf)
    one_by_one: list[bytes] | None = []
    try:
        while (payload := ring.reader.take()) is not None:
            one_by_one.append(payload)  # type: ignore[union-attr]
    except Corrupt:
        one_by_one = None
    after = ring.word(TAIL)
    ring.buf[:] = before
    ring.reader._tail = tail  # the reader's own position, as it was before the takes
    if one_by_one is None:
        with pytest.raises(Corrupt):
            ring.reader.take_all()
        assert ring.word(TAIL) == tail  # nothing taken
        return
    assert [bytes(p) for p in ring.reader.take_all()] == one_by_one
    assert ring.word(TAIL) == after
    assert ring.reader.take() is None


# ---- a hostile reader, seen by the writer ----


@PROFILE
@given(data=st.data())
def test_a_reader_position_ahead_of_the_writer_or_more_than_capacity_behind_is_corrupt(
    data: st.DataObject,
) -> None:
    capacity = data.draw(capacities)
    ring = advanced(capacity, data.draw(st.lists(sizes_for(capacity), max_size=10)))
    head = ring.word(HEAD)
    low = st.integers(0, head - capacity - 1) if head > capacity else st.nothing()
    ring.set_word(TAIL, data.draw(low | st.integers(head + 1, U64)))
    with pytest.raises(Corrupt, match="the reader's position"):
        ring.writer.reserve(data.draw(sizes_for(capacity)))
    assert ring.word(HEAD) == head


@PROFILE
@given(data=st.data())
def test_whatever_the_reader_publishes_reserve_gives_room_inside_the_data_none_or_corrupt(
    data: st.DataObject,
) -> None:
    capacity = data.draw(capacities)
    ring = advanced(capacity, data.draw(st.lists(sizes_for(capacity), max_size=10)))
    head = ring.word(HEAD)
    ring.set_word(TAIL, data.draw(st.integers(max(0, head - capacity), head) | st.integers(0, U64)))
    size = data.draw(sizes_for(capacity))
    try:
        room = ring.writer.reserve(size)
    except Corrupt:
        return
    if room is not None:
        assert len(room) == size
        room[:] = b"\xaa" * size
        room.release()
        assert b"\xaa" * size in ring.data
