"""ReceiveCredit's count of the bytes nobody consumed yet (what holds connection credit back),
on a real aioquic connection: `make mutate` found no unit test reaching these lines of
transport/h3/aioquic/credit.py."""

from __future__ import annotations

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.h3.aioquic.credit import FRAMING_SLACK, ReceiveCredit

PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, database=None)
STREAMS = (0, 4, 8)


def credit() -> ReceiveCredit:
    return ReceiveCredit(QuicConnection(configuration=QuicConfiguration(is_client=True)))


@PROPERTY
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["received", "consumed", "stop", "forget"]),
            st.sampled_from(STREAMS),
            st.integers(0, 1 << 20),
        ),
        max_size=30,
    )
)
def test_unconsumed_is_what_the_live_streams_hold(steps: list[tuple[str, int, int]]) -> None:
    """Consuming never takes more than a stream holds; a stopped or forgotten stream holds
    nothing any more."""
    tracked = credit()
    held = dict.fromkeys(STREAMS, 0)
    for action, stream, size in steps:
        if action == "received":
            tracked.received(stream, size)
            held[stream] += size
        elif action == "consumed":
            tracked.consumed(stream, size)
            held[stream] -= min(size, held[stream])
        else:
            getattr(tracked, action)(stream)
            held[stream] = 0
        assert tracked.unconsumed == sum(held.values())


def test_consuming_on_a_stream_that_holds_nothing_changes_nothing() -> None:
    tracked = credit()
    tracked.received(0, 100)
    tracked.consumed(4, 10)
    tracked.message_in_progress(4, 1000)
    tracked.message_in_progress(4, 0)
    assert tracked.unconsumed == 100


def test_the_windows_docs_http3_states() -> None:
    """About 1 MiB per stream, a 16 MiB connection window, 16 KiB for the framing."""
    tracked = credit()
    assert (tracked.stream_window, tracked.connection_window) == (1 << 20, 16 << 20)
    assert FRAMING_SLACK == 16 << 10


def test_at_most_64_stopped_streams_are_remembered_none_that_aioquic_keeps_forgotten() -> None:
    """A peer that opens and resets streams for the life of a connection must not grow what
    the connection remembers: at 64, the stopped streams aioquic has discarded are
    forgotten, and those it still has stay stopped."""
    tracked = credit()
    tracked.quic.send_stream_data(0, b"x")  # a stream aioquic keeps
    tracked.stop(0)
    sizes = []
    for stream_id in range(4, 4 * 200, 4):  # streams aioquic no longer has
        tracked.stop(stream_id)
        sizes.append(len(tracked._stopped))
    assert max(sizes) == 64
    assert sizes[:64] == [*range(2, 65), 2]
    assert 0 in tracked._stopped
