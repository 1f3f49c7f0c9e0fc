"""How long a dead worker waits before it is started again: pure, so the policy is one place."""

from __future__ import annotations

MAX_RESTART_DELAY_S = 30.0


def delay_after_death(delay: float, lived_s: float, answered: bool) -> float:
    """Back off only for a worker that keeps dying young without answering anything (a
    crash loop); one that was serving comes back at once."""
    return 0.0 if lived_s > MAX_RESTART_DELAY_S or answered else delay_after_failure(delay)


def delay_after_failure(delay: float) -> float:
    """The delay before the next start, after one more that failed."""
    return min(max(1.0, delay * 2), MAX_RESTART_DELAY_S)
