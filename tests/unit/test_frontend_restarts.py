"""The pause before a front-end that exited is started again (operations.md, Supervision):
0.2 s, doubling up to 10 s while it keeps dying within 10 s of its start, 0.2 s again after a
run that lived longer. The decision takes each run's lifetime, so no test waits for one. And
what a dead front-end counted towards the host's limits is cleared before its successor
starts."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from service import settings as settings_module
from service.frontends.host_limits import FrontendTally, ParentTally
from service.frontends.supervisor import (
    FIRST_DELAY_S,
    MAX_DELAY_S,
    YOUNG_S,
    RestartBackoff,
    Supervisor,
)
from tests.conformance.conftest import eventually
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


async def test_a_dead_front_end_s_counts_are_cleared_before_its_successor_starts(
    tmp_path: Path,
) -> None:
    """Between a front-end's death and its successor's start (which clears its own block too)
    what it held must not count against the other front-ends: the parent clears it first.
    The front-end here dies at its start (its runtime directory is missing) before it touches
    the segment, so only the parent can clear what the test wrote in its place."""
    settings = settings_module.parse([])
    tally = ParentTally(settings, 2)
    dead = FrontendTally(os.dup(tally.fd), settings, 2, 0)
    other = FrontendTally(os.dup(tally.fd), settings, 2, 1)
    dead.h3(0).set(0, 5)
    dead.h3(0).set_at("10.0.0.1", (2, 4096))
    dead.rest().set(0, 3)

    def held() -> tuple[int, list[int], int]:
        return other.h3(0).others(0), other.h3(0).others_at("10.0.0.1"), other.rest().others(0)

    assert held() == (5, [2, 4096], 3)
    at_restart: list[tuple[int, list[int], int]] = []
    supervisor = Supervisor(1, tmp_path / "missing", lambda: at_restart.append(held()), tally)
    supervisor.start()
    try:

        async def restarted() -> bool:
            return bool(at_restart)

        await eventually(restarted, "the front-end's death seen", attempts=1500)
    finally:
        await supervisor.stop(0.0)  # closes the parent's segment too
    assert at_restart[0] == (0, [0, 0], 0)
