"""One worker's queue segment (service/queues/layout.py) over a plain buffer: its two rings
and its running area do not overlap, the running area says which requests the worker runs,
and what a hostile worker writes there is clamped or refused with Corrupt."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.queues.layout import MAX_OTHERS_HELD, QueueLayout, RunningReader, RunningWriter
from service.queues.ring import Corrupt, RingReader, RingWriter, max_record

PROFILE = settings(max_examples=200, deadline=None, derandomize=True, database=None)
U64 = 2**64 - 1
COUNT = 8  # where the running area keeps its request count (after the batch number)
# Words before the ids: batch number, request count, the last batch ended, others' held.
HEAD = 4


def running_area(slots: int) -> tuple[bytearray, RunningWriter, RunningReader]:
    """The running area of a segment, from the worker's end and from the caller's."""
    layout = QueueLayout(request_bytes=64, reply_bytes=64, running_slots=slots)
    buf = bytearray(layout.size)
    view = memoryview(buf)
    return buf, layout.worker_end(view)[2], layout.caller_end(view)[2]


def running_offset(buf: bytearray, writer: RunningWriter) -> int:
    """Where the area lies in the segment: found by the batch number it writes."""
    before = bytes(buf)
    writer.begin(1, [])
    changed = [i for i, (a, b) in enumerate(zip(before, buf, strict=True)) if a != b]
    writer.end()
    return changed[0]


@PROFILE
@given(slots=st.integers(1, 40), data=st.data())
def test_the_caller_reads_the_batch_the_worker_runs_and_that_it_ended(
    slots: int, data: st.DataObject
) -> None:
    _, writer, reader = running_area(slots)
    assert reader.batch() == (0, 0)
    assert reader.running() == set()
    assert reader.ended() == 0
    batches = data.draw(st.lists(st.lists(st.integers(0, U64), max_size=slots), max_size=5))
    for number, ids in enumerate(batches, start=1):
        writer.begin(number, ids)
        assert reader.batch() == (number, len(ids))
        assert reader.running() == set(ids)
        assert reader.ended() == number - 1  # running, not ended
        writer.end()
        assert reader.batch() == (number, 0)
        assert reader.running() == set()
        assert reader.ended() == number


@PROFILE
@given(slots=st.integers(1, 40), counts=st.lists(st.integers(0, MAX_OTHERS_HELD), max_size=5))
def test_the_caller_reads_how_many_requests_of_others_the_worker_holds(
    slots: int, counts: list[int]
) -> None:
    _, writer, reader = running_area(slots)
    assert reader.others_held() == 0
    for number, count in enumerate(counts, start=1):
        writer.others_held(count)
        writer.begin(number, list(range(min(count, slots))))
        assert reader.others_held() == count  # not touched by the batch's own words
        writer.end()
        assert reader.others_held() == count


def test_a_batch_of_more_requests_than_the_area_holds_is_a_value_error() -> None:
    _, writer, reader = running_area(4)
    writer.begin(1, [1, 2])
    with pytest.raises(ValueError, match="a batch of 5 requests; the area holds 4"):
        writer.begin(2, [1, 2, 3, 4, 5])
    assert reader.batch() == (1, 2)
    assert reader.running() == {1, 2}


@PROFILE
@given(slots=st.integers(1, 40), count=st.integers(0, U64))
def test_a_count_above_the_slots_is_corrupt_and_batch_clamps_it(slots: int, count: int) -> None:
    buf, writer, reader = running_area(slots)
    at = running_offset(buf, writer)
    writer.begin(2, list(range(slots)))
    struct.pack_into("<Q", buf, at + COUNT, count)
    assert reader.batch() == (2, min(count, slots))
    if count > slots:
        with pytest.raises(Corrupt, match=f"a running batch of {count} requests"):
            reader.running()
    else:
        assert reader.running() == set(range(count))


@PROFILE
@given(slots=st.integers(1, 40), data=st.data())
def test_whatever_the_worker_scribbles_the_caller_reads_at_most_its_slots_or_corrupt(
    slots: int, data: st.DataObject
) -> None:
    buf, writer, reader = running_area(slots)
    at = running_offset(buf, writer)
    size = slots + HEAD
    words = data.draw(st.lists(st.integers(0, U64), min_size=size, max_size=size))
    words[1] = data.draw(st.integers(0, slots + 1) | st.just(words[1]))
    struct.pack_into(f"<{size}Q", buf, at, *words)
    number, count = reader.batch()
    assert (number, count) == (words[0], min(words[1], slots))
    assert reader.ended() == words[2]  # only whether it served: the restart's wait
    assert reader.others_held() == min(words[3], MAX_OTHERS_HELD)  # a hint, clamped
    try:
        running = reader.running()
    except Corrupt:
        assert words[1] > slots
        return
    assert running == set(words[HEAD : HEAD + words[1]])


# ---- the segment ----

layouts = st.builds(
    QueueLayout,
    request_bytes=st.integers(1, 16).map(lambda lines: 64 * lines),
    reply_bytes=st.integers(1, 16).map(lambda lines: 64 * lines),
    running_slots=st.integers(1, 20),
)


def fill(writer: RingWriter, seed: int) -> list[bytes]:
    """Records until the ring is full."""
    rng = random.Random(seed)
    written: list[bytes] = []
    while True:
        payload = rng.randbytes(rng.randint(0, max_record(writer.capacity)))
        room = writer.reserve(len(payload))
        if room is None:
            return written
        room[:] = payload
        room.release()
        writer.commit()
        written.append(payload)


def drain(reader: RingReader) -> list[bytes]:
    taken: list[bytes] = []
    while (payload := reader.take()) is not None:
        taken.append(payload)
    return taken


@PROFILE
@given(layout=layouts, seed=st.integers(0, 1000))
def test_the_rings_and_the_running_area_of_a_segment_do_not_overlap(
    layout: QueueLayout, seed: int
) -> None:
    """Each side fills what it writes (the caller its request ring, the worker its reply ring
    and running area); the other side reads all of it back intact."""
    buf = memoryview(bytearray(layout.size + 64))  # a segment may be larger than its layout
    requests, replies, running = layout.caller_end(buf)
    take_requests, answer, run = layout.worker_end(buf)
    sent = fill(requests, seed)
    answered = fill(answer, seed + 1)
    ids = list(range(seed, seed + layout.running_slots))
    run.begin(1, ids)
    assert drain(take_requests) == sent
    assert drain(replies) == answered
    assert running.batch() == (1, layout.running_slots)
    assert running.running() == set(ids)
    assert sent
    assert answered


def test_a_segment_smaller_than_its_layout_is_a_value_error() -> None:
    layout = QueueLayout(request_bytes=128, reply_bytes=128, running_slots=4)
    buf = memoryview(bytearray(layout.size - 1))
    with pytest.raises(ValueError, match=f"the layout needs {layout.size}"):
        layout.caller_end(buf)
    with pytest.raises(ValueError, match=f"the layout needs {layout.size}"):
        layout.worker_end(buf)
