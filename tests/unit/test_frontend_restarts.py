"""The pause before a front-end that exited is started again (operations.md, Supervision):
0.2 s, doubling up to 10 s while it keeps dying within 10 s of its start, 0.2 s again after a
run that lived longer. The decision takes each run's lifetime, so no test waits for one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from service.frontends.supervisor import (
    FIRST_DELAY_S,
    MAX_DELAY_S,
    YOUNG_S,
    RestartBackoff,
)
from tests.unit.test_validation import property_settings

YOUNG = YOUNG_S / 2


def test_the_promised_bounds() -> None:
    assert (FIRST_DELAY_S, MAX_DELAY_S, YOUNG_S) == (0.2, 10.0, 10.0)


def test_a_front_end_that_keeps_dying_young_waits_doubling_up_to_the_cap() -> None:
    backoff = RestartBackoff()
    pauses = [backoff.pause(YOUNG) for _ in range(9)]
    assert pauses == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0, 10.0]


def test_a_run_that_lived_long_resets_the_pause() -> None:
    backoff = RestartBackoff()
    for _ in range(8):
        backoff.pause(YOUNG)
    assert backoff.pause(YOUNG_S) == FIRST_DELAY_S  # lived exactly YOUNG_S: not young
    assert backoff.pause(YOUNG) == FIRST_DELAY_S * 2


@property_settings(200)
@given(st.lists(st.floats(0.0, 3 * YOUNG_S), max_size=40))
def test_every_pause_follows_from_the_lifetimes(lifetimes: list[float]) -> None:
    """Whatever the history: the first pause and every pause after a long run are 0.2 s; a
    pause after a young run doubles the previous one, capped at 10 s."""
    backoff = RestartBackoff()
    previous: float | None = None
    for lived in lifetimes:
        pause = backoff.pause(lived)
        if previous is None or lived >= YOUNG_S:
            assert pause == FIRST_DELAY_S
        else:
            assert pause == min(previous * 2, MAX_DELAY_S)
        assert FIRST_DELAY_S <= pause <= MAX_DELAY_S
        previous = pause
