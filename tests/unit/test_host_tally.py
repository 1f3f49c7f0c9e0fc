"""Counts shared by the processes on one port (transport/host_tally.py): what one process sets,
every other reads, through any sequence of changes, removals and full tables."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.host_tally import (
    HostTally,
    TallyLayout,
    address_key,
    clear_block,
    create,
    slots_for,
)

LAYOUT = TallyLayout(processes=3, counters=2, slots=8, columns=2)


@pytest.fixture
def segment() -> Iterator[int]:
    fd = create(LAYOUT)
    yield fd
    os.close(fd)


def test_counters_are_each_process_own_and_summed_by_the_others(segment: int) -> None:
    tallies = [HostTally(segment, LAYOUT, index) for index in range(3)]
    tallies[0].set(0, 5)
    tallies[1].set(0, 7)
    tallies[2].set(1, 1)
    assert [t.others(0) for t in tallies] == [7, 5, 12]
    assert [t.others(1) for t in tallies] == [1, 1, 0]
    for tally in tallies:
        tally.close()


def test_a_dead_process_block_cleared_by_the_parent_counts_nothing(segment: int) -> None:
    dead, alive = HostTally(segment, LAYOUT, 0), HostTally(segment, LAYOUT, 1)
    dead.set(0, 9)
    assert dead.set_at(address_key(0, "10.0.0.1"), (3, 100))
    clear_block(segment, LAYOUT, 0)
    assert alive.others(0) == 0
    assert alive.others_at(address_key(0, "10.0.0.1")) == [0, 0]
    dead.close()
    alive.close()


def test_a_writer_stopped_mid_change_still_shows_its_other_entries(segment: int) -> None:
    """A writer preempted while it changes its table (its sequence odd for as long as it is
    stopped) must not read as empty: its entries that the change does not move are still
    counted. And a count changed in place (each reservation of bytes) leaves the sequence
    as it is, so it never makes a reader retry. (CI once saw two front-ends hold 3.0 MB for
    one address against its 2 MB receive budget; a reader that took a table mid-update for
    empty admits that much.)"""
    writer, reader = HostTally(segment, LAYOUT, 0), HostTally(segment, LAYOUT, 1)
    assert writer.set_at(9, (5, 100))
    sequence = writer._words[writer._block]
    assert writer.set_at(9, (6, 200))
    assert writer._words[writer._block] == sequence
    writer._words[writer._block] += 1  # stopped mid-change, as if preempted there
    assert reader.others_at(9) == [6, 200]
    writer._words[writer._block] += 1
    writer.close()
    reader.close()


def test_keys_differ_by_scope_and_address_and_are_never_zero() -> None:
    keys = {address_key(scope, address) for scope in (0, 1) for address in ("::1", "127.0.0.1")}
    assert len(keys) == 4 and 0 not in keys
    assert address_key(1, "::1") == address_key(1, "::1")


def test_a_half_full_table_refuses_a_new_entry_and_takes_it_once_one_goes(segment: int) -> None:
    tally = HostTally(segment, LAYOUT, 0)
    keys = [address_key(0, f"10.0.0.{n}") for n in range(LAYOUT.slots // 2 + 1)]
    for key in keys[:-1]:
        assert tally.set_at(key, (1, 0))
    assert not tally.set_at(keys[-1], (1, 0))
    assert tally.set_at(keys[-1], (0, 0))  # nothing to hold: nothing refused
    assert tally.set_at(keys[0], (0, 0))
    assert tally.set_at(keys[-1], (1, 0))
    assert tally.set_at(keys[1], (2, 5))  # one it holds changes whatever the room
    tally.close()


def test_slots_for_leave_three_quarters_empty() -> None:
    assert slots_for(1) == 4
    assert slots_for(1024) == 4096


# Keys whose homes (key & 7) collide, runs that wrap around the table's end, and many removals
# (values of zeros), so entries move back into the gaps their removals leave.
_KEYS = [1, 9, 17, 6, 7, 15, 23, -1]
_CHANGES = st.lists(
    st.tuples(
        st.integers(0, 1),  # which writer
        st.sampled_from(_KEYS),
        st.sampled_from([(0, 0), (0, 0), (1, 0), (0, 2), (3, 1)]),
    ),
    max_size=80,
)


@settings(max_examples=400, deadline=None)
@given(_CHANGES)
def test_every_reader_sees_what_each_writer_holds(
    changes: list[tuple[int, int, tuple[int, int]]],
) -> None:
    fd = create(LAYOUT)
    try:
        tallies = [HostTally(fd, LAYOUT, index) for index in range(3)]
        model: list[dict[int, tuple[int, int]]] = [{}, {}]
        for writer, key, values in changes:
            live = sum(1 for held in model[writer].values() if any(held))
            fits = (key in model[writer] and any(model[writer][key])) or live < LAYOUT.slots // 2
            assert tallies[writer].set_at(key, values) == (fits or not any(values))
            if fits or not any(values):
                model[writer][key] = values
            for key_ in _KEYS:
                held = [m.get(key_, (0, 0)) for m in model]
                assert tallies[2].others_at(key_) == [sum(c) for c in zip(*held, strict=True)]
                assert tallies[0].others_at(key_) == list(held[1])
        for tally in tallies:
            tally.close()
    finally:
        os.close(fd)
