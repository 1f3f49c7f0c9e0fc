"""The in-memory ticket store's bounds, exactly (docs/http3.md: expire after 1 h by default, at
most 100 000 tickets) and its counters: what `make mutate` found no test for in
transport/tls/session_tickets.py."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_tickets import FakeClock, ticket
from transport.tls.session_tickets import MemoryTicketStore

PROPERTY = settings(max_examples=25, deadline=None, derandomize=True, database=None)


@PROPERTY
@given(ttl=st.sampled_from([None, 1.0, 60.0, 86400.0]), early=st.floats(1e-3, 0.999))
def test_a_ticket_is_refused_from_the_moment_it_expires(ttl: float | None, early: float) -> None:
    clock = FakeClock()
    store = MemoryTicketStore(clock=clock) if ttl is None else MemoryTicketStore(ttl, clock=clock)
    lifetime = 3600.0 if ttl is None else ttl
    store.add(ticket(b"early"))
    store.add(ticket(b"on time"))
    clock.now += lifetime * early
    assert store.pop(b"early") is not None
    clock.now = 100.0 + lifetime
    assert store.pop(b"on time") is None


def test_the_default_store_holds_100_000_tickets_and_counts_what_happens() -> None:
    store = MemoryTicketStore(clock=FakeClock())
    template = ticket(b"")
    for i in range(100_001):
        store.add(dataclasses.replace(template, ticket=b"%d" % i))
    assert len(store) == 100_000
    assert store.pop(b"0") is None  # the oldest went first
    assert store.pop(b"1") is not None and store.pop(b"100000") is not None
    assert store.pop(b"1") is None  # single use
    counters = store.counters
    assert (counters.issued, counters.evicted, counters.redeemed, counters.refused) == (
        100_001,
        1,
        2,
        2,
    )
