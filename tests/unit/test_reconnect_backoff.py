"""The HTTP/3 client's jittered exponential backoff (http3.md, Reconnects), for a new
connection and for a refused call sent again: the delay doubles from 0.05 s up to 5 s, and each
pause is that delay times a factor drawn from 0.5 to 1.5, here from a seeded generator."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from clients.backoff import FIRST_BACKOFF_S, MAX_BACKOFF_S, backoff_delay, jittered
from tests.unit.test_validation import property_settings


def test_the_delay_doubles_up_to_the_cap() -> None:
    assert (FIRST_BACKOFF_S, MAX_BACKOFF_S) == (0.05, 5.0)
    delays = [backoff_delay(attempt) for attempt in range(10)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    assert backoff_delay(10_000) == MAX_BACKOFF_S  # no overflow, however long it retried


@property_settings(200)
@given(st.integers(0, 64), st.integers(0, 2**32))
def test_every_pause_is_the_delay_jittered_by_half_either_way(attempt: int, seed: int) -> None:
    delay = backoff_delay(attempt)
    pause = jittered(delay, random.Random(seed))
    assert 0.5 * delay <= pause <= 1.5 * delay
    assert pause == jittered(delay, random.Random(seed))  # the generator decides it all


def test_clients_that_lost_the_same_server_do_not_come_back_in_step() -> None:
    """Many clients at the same attempt: their pauses spread over the whole range."""
    rng = random.Random(22)
    delay = backoff_delay(3)
    pauses = sorted(jittered(delay, rng) for _ in range(1000))
    assert len(set(pauses)) == len(pauses)
    assert pauses[0] < 0.55 * delay and pauses[-1] > 1.45 * delay
    below = sum(p < delay for p in pauses)
    assert 400 < below < 600  # about half either side of the delay
