"""The receive credit decision (`credit_limit`), alone and driven by a model of one request
stream: a peer that sends whatever the credit allows, DATA frames of any size carrying
messages of any size up to the maximum, and a reader that takes each message once it is whole.
Every message must complete, and the stream must never hold more than its bound."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from transport.grpc.framing import DEFAULT_MAX_MESSAGE, HEADER_SIZE
from transport.h3.aioquic.credit import DEFAULT_STREAM_WINDOW, FRAMING_SLACK, credit_limit

WINDOW = DEFAULT_STREAM_WINDOW
BATCH = WINDOW // 2
HEADERS_FRAME = 60  # the request's HEADERS frame, held by the H3 layer until it is whole
MODEL = settings(max_examples=60, deadline=None, derandomize=True, database=None)


def varint_size(value: int) -> int:
    return 1 if value < 1 << 6 else 2 if value < 1 << 14 else 4 if value < 1 << 30 else 8


@dataclass
class Stream:
    """Where the frame headers, frame payloads and messages of a stream's bytes lie."""

    frame_starts: list[int]  # offset of each frame
    header_sizes: list[int]
    payload_before: list[int]  # payload bytes in the frames before each frame
    message_ends: list[int]  # payload offset where each message (prefix included) ends
    size: int

    @classmethod
    def of(cls, messages: list[int], head: int, chunk: int) -> Stream:
        """Messages (wire sizes) sent as one payload cut into DATA frames: `head` bytes, then
        `chunk` bytes each."""
        payload = sum(messages)
        pieces = [min(head, payload)]
        pieces += [chunk] * (-(-(payload - pieces[0]) // chunk))
        pieces[-1] -= sum(pieces) - payload
        stream = cls([0], [HEADERS_FRAME], [0], list(itertools.accumulate(messages)), 0)
        offset, before = HEADERS_FRAME, 0
        for piece in pieces:
            stream.frame_starts.append(offset)
            stream.header_sizes.append(1 + varint_size(piece))
            stream.payload_before.append(before)
            offset += stream.header_sizes[-1] + piece
            before += piece
        stream.size = offset
        return stream

    def observe(self, received: int) -> tuple[int, int]:
        """With the first `received` bytes in, after the reader took every whole message:
        the bytes held (a partial frame header, a partial message) and the credit need of the
        message in progress (its size plus the slack, once its prefix is in; 0 otherwise)."""
        frame = bisect.bisect_right(self.frame_starts, received) - 1
        into = received - self.frame_starts[frame]
        header = self.header_sizes[frame]
        if frame == 0 or into < header:
            partial_header, payload = min(into, header), self.payload_before[frame]
        else:
            partial_header, payload = 0, self.payload_before[frame] + into - header
        whole = bisect.bisect_right(self.message_ends, payload)
        taken = self.message_ends[whole - 1] if whole else 0
        partial_message = payload - taken
        need = 0
        if partial_message >= HEADER_SIZE:
            need = self.message_ends[whole] - taken + FRAMING_SLACK
        return partial_header + partial_message, need


def deliver(stream: Stream, packet: int) -> tuple[int, int]:
    """Run the peer and the receiver until everything arrived: the peer sends up to `packet`
    bytes at a time within its credit, the receiver decides its credit after each. Returns
    (credit updates, most bytes held)."""
    limit, received, updates, peak = WINDOW, 0, 0, 0
    while True:
        held, need = stream.observe(received)
        peak = max(peak, held)
        new_limit = credit_limit(limit, received, held, max(WINDOW, need), BATCH, held <= need)
        assert new_limit >= limit
        updates += new_limit != limit
        limit = new_limit
        if received == stream.size:
            return updates, peak
        sendable = min(stream.size, limit, received + packet)
        assert sendable > received, f"the peer is blocked at {received} of {stream.size}"
        received = sendable


def around(points: tuple[int, ...]) -> st.SearchStrategy[int]:
    delta = st.one_of(st.integers(-64, 64), st.integers(-BATCH, BATCH))
    return st.builds(lambda at, by: max(HEADER_SIZE, at + by), st.sampled_from(points), delta)


MESSAGE = around((BATCH, WINDOW - FRAMING_SLACK, WINDOW, WINDOW + BATCH, 2 * WINDOW))


@MODEL
@given(
    messages=st.lists(MESSAGE, min_size=1, max_size=4),
    head=st.integers(1, 12),
    chunk=st.sampled_from([7, 1000, 16384, 65536, 1 << 30]),
    packet=st.sampled_from([1200, 65536, 1 << 30]),
)
@example(messages=[int(1.2 * WINDOW)], head=1 << 30, chunk=1 << 30, packet=1200)
@example(messages=[2 * WINDOW], head=5, chunk=65536, packet=1 << 30)
@example(messages=[300_000, 900_000], head=5, chunk=16384, packet=1 << 30)
def test_every_message_completes_within_its_bound(
    messages: list[int], head: int, chunk: int, packet: int
) -> None:
    updates, peak = deliver(Stream.of(messages, head, chunk), packet)
    assert peak <= max(WINDOW, max(messages) + FRAMING_SLACK)
    # A grant per half window, plus a few per message for the framing of its last frames.
    assert updates <= 2 * sum(messages) // BATCH + 4 * len(messages) + 2


@settings(max_examples=3, deadline=None, derandomize=True, database=None)
@given(head=st.integers(1, 9))
def test_the_largest_message_completes(head: int) -> None:
    _, peak = deliver(Stream.of([DEFAULT_MAX_MESSAGE + HEADER_SIZE], head, 1 << 20), 1 << 30)
    assert peak <= DEFAULT_MAX_MESSAGE + HEADER_SIZE + FRAMING_SLACK


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    limit=st.integers(0, 1 << 40),
    spent=st.integers(0, 1 << 30),
    held=st.integers(0, 1 << 30),
    window=st.integers(1, 1 << 30),
    reader_waits=st.booleans(),
)
def test_credit_never_shrinks_and_a_waiting_reader_unblocks_the_peer(
    limit: int, spent: int, held: int, window: int, reader_waits: bool
) -> None:
    received = max(0, limit - spent)
    held = min(held, received)
    granted = credit_limit(limit, received, held, window, window // 2, reader_waits)
    assert granted in (limit, received - held + window)
    assert granted >= limit
    if received == limit and held < window and reader_waits:
        assert granted > limit


def test_small_increments_wait_while_the_peer_has_room() -> None:
    """Consumption of less than the batch, the peer far from its limit: no update."""
    assert credit_limit(WINDOW, 1000, 0, WINDOW, BATCH, True) == WINDOW
    assert credit_limit(WINDOW, BATCH + 1000, 0, WINDOW, BATCH, True) == BATCH + 1000 + WINDOW


def test_a_batch_is_granted_from_its_first_byte_and_the_slack_is_a_strict_bound() -> None:
    """Exactly a batch consumed is granted; the peer's last `FRAMING_SLACK` bytes count as
    running out while the reader waits, one byte more left does not."""
    assert credit_limit(WINDOW, BATCH - 1, 0, WINDOW, BATCH, False) == WINDOW
    assert credit_limit(WINDOW, BATCH, 0, WINDOW, BATCH, False) == BATCH + WINDOW
    left = WINDOW - FRAMING_SLACK  # received: the peer has FRAMING_SLACK bytes left
    moved = 1000  # the reader holds all but 1000 bytes of it: far less than a batch
    assert credit_limit(WINDOW, left, left - moved, WINDOW, BATCH, True) == WINDOW
    grown = WINDOW + moved
    assert credit_limit(WINDOW, left + 1, left + 1 - moved, WINDOW, BATCH, True) == grown
    assert credit_limit(WINDOW, left + 1, left + 1 - moved, WINDOW, BATCH, False) == WINDOW
