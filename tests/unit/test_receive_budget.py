"""The HTTP/3 receive budget shared by a server's connections (transport/h3/receive_budget.py):
the accounting alone, then ReceiveCredit admitting streams and promoting messages with it."""

from __future__ import annotations

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicStreamFrame
from aioquic.quic.stream import QuicStream
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.h3.aioquic.credit import FRAMING_SLACK, NARROW_STREAM_WINDOW, ReceiveCredit
from transport.h3.receive_budget import AddressShare, ReceiveBudget, SharedReceiveBudget

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)
ADDRESSES = ("10.0.0.1", "10.0.0.2", "::1")
WINDOW = 1 << 20

operations = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "release"]),
        st.sampled_from(ADDRESSES),
        st.integers(0, 5000),
    ),
    max_size=60,
)


@PROPERTY
@given(total=st.integers(0, 8000), per_address=st.integers(0, 5000), steps=operations)
def test_reservations_stay_within_both_limits(
    total: int, per_address: int, steps: list[tuple[str, str, int]]
) -> None:
    """A reservation is granted whole exactly when both limits allow it, else nothing
    changes; a release never gives back more than the address holds."""
    budget = ReceiveBudget(total, per_address)
    model = dict.fromkeys(ADDRESSES, 0)
    for action, address, size in steps:
        if action == "reserve":
            fits = model[address] + size <= per_address and sum(model.values()) + size <= total
            assert budget.reserve(address, size) == fits
            model[address] += size if fits else 0
        else:
            budget.release(address, size)
            model[address] -= min(size, model[address])
        assert {a: budget.held(a) for a in ADDRESSES} == model
        assert budget.reserved_total == sum(model.values()) <= total
        assert all(held <= per_address for held in model.values())
        assert all(held > 0 for held in budget.reserved.values())  # no empty entries kept


@PROPERTY
@given(steps=operations)
def test_one_address_cannot_take_what_the_others_are_promised(
    steps: list[tuple[str, str, int]],
) -> None:
    """However one address reserves and releases, the others can still reserve up to their
    share when the total allows every address its share."""
    budget = ReceiveBudget(total=3 * 5000, per_address=5000)
    for action, _, size in steps:
        getattr(budget, action)(ADDRESSES[0], size)
    assert budget.reserve(ADDRESSES[1], 5000) and budget.reserve(ADDRESSES[2], 5000)


def test_a_release_retries_the_waiters_oldest_first() -> None:
    shared = SharedReceiveBudget(ReceiveBudget(total=100, per_address=100))
    assert shared.reserve("a", 100)
    retried: list[str] = []
    shared.wait("first", lambda: retried.append("first"))
    shared.wait("second", lambda: retried.append("second"))
    shared.stop_waiting("second")
    shared.wait("third", lambda: retried.append("third"))
    shared.release("a", 10)
    assert retried == ["first", "third"]
    shared.release("a", 10)  # each wait is retried once
    assert retried == ["first", "third"]
    assert shared.peak_total == 100


def connection_credit(shared: SharedReceiveBudget, address: str) -> ReceiveCredit:
    credit = ReceiveCredit(QuicConnection(configuration=QuicConfiguration(is_client=True)))
    credit.use_budget(AddressShare(shared, address), lambda: None)
    return credit


def test_streams_get_windows_then_narrow_ones_then_are_refused_across_connections() -> None:
    """Full windows up to half the address's budget, narrow ones in the rest: many streams
    still run when some hold full windows, and no address takes another's share."""
    shared = SharedReceiveBudget(ReceiveBudget(total=10 * WINDOW, per_address=2 * WINDOW))
    first, second = connection_credit(shared, "a"), connection_credit(shared, "a")
    assert first.admit(0) and first.reserved() == WINDOW
    narrow = WINDOW // NARROW_STREAM_WINDOW
    for stream_id in range(0, 4 * narrow, 4):
        assert second.admit(stream_id)
    assert second.reserved() == WINDOW  # narrow windows, across connections
    assert not second.admit(4 * narrow) and not first.admit(4)
    assert connection_credit(shared, "b").admit(0)  # another address is not refused
    second.forget(0)
    assert second.admit(4 * narrow)


def test_a_stream_whose_end_arrived_with_its_headers_reserves_its_size() -> None:
    """A unary request usually arrives whole in one packet: it takes what it holds from the
    budget, not a window, so many concurrent calls fit a budget of a few windows."""
    shared = SharedReceiveBudget(ReceiveBudget(total=10 * WINDOW, per_address=WINDOW))
    credit = connection_credit(shared, "a")
    for stream_id in range(0, 400, 4):
        stream = QuicStream(stream_id, max_stream_data_local=WINDOW, max_stream_data_remote=0)
        stream.receiver.handle_frame(QuicStreamFrame(offset=0, data=bytes(1000), fin=True))
        credit.quic._streams[stream_id] = stream
        assert credit.admit(stream_id)
    assert shared.budget.held("a") == 100 * 1000


def test_a_large_message_waits_for_all_of_itself_then_completes() -> None:
    """No deadlock: a message is promoted only once all of it is reserved, so a promoted one
    needs nothing more to finish, and its release lets the waiting one go."""
    shared = SharedReceiveBudget(ReceiveBudget(total=100 * WINDOW, per_address=12 * WINDOW))
    holder, waiter = connection_credit(shared, "a"), connection_credit(shared, "a")
    size = 8 * WINDOW
    assert holder.admit(0) and waiter.admit(0)
    holder.message_in_progress(0, size)
    assert holder.reserved() == size + FRAMING_SLACK
    waiter.message_in_progress(0, size)
    assert waiter.reserved() == WINDOW  # waits, within its window
    assert shared.budget.held("a") <= 12 * WINDOW
    holder.forget(0)  # the holder's call ended: what it reserved goes back
    assert waiter.reserved() == size + FRAMING_SLACK
    waiter.close()
    assert shared.budget.reserved_total == 0
