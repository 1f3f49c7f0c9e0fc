"""A decoupled worker's Outbox: what its writer takes in one write is the messages queued, in
order, joined up to a bound, and nothing after the close."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from service.backend.response_flow import Outbox


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    sizes=st.lists(st.integers(1, 300), max_size=40),
    most=st.integers(1, 1000),
    after_close=st.lists(st.integers(1, 10), max_size=3),
)
def test_the_writer_takes_every_message_in_order_joined_up_to_the_bound(
    sizes: list[int], most: int, after_close: list[int]
) -> None:
    outbox = Outbox(lambda reply: b"")
    messages = [bytes([index % 256]) * size for index, size in enumerate(sizes)]
    for message in messages:
        outbox.post(message)
    outbox.close()
    for size in after_close:  # never written: the writer stops at the close
        outbox.post(b"x" * size)
    writes = []
    while (write := outbox.next(most)) is not None:
        writes.append(write)
    assert b"".join(writes) == b"".join(messages)
    # Each write is whole messages, holds a next one only while it is under the bound, and
    # stops short of the messages queued only at the bound (all were queued before it).
    assert all(len(write) >= most for write in writes[:-1])
    remaining = iter(messages)
    for write in writes:
        taken = [next(remaining)]
        while sum(map(len, taken)) < len(write):
            assert sum(map(len, taken)) < most
            taken.append(next(remaining))
        assert b"".join(taken) == write
    assert outbox.next(most) is None
