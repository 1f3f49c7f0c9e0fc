"""The pause before a client tries again (a new connection, a refused call sent anew): a delay
that doubles with each attempt up to MAX_BACKOFF_S, jittered so that clients that lost the
same server do not come back in step."""

from __future__ import annotations

import random

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0
_DOUBLINGS = 16  # past these, the delay is MAX_BACKOFF_S whatever the attempt


def backoff_delay(attempt: int) -> float:
    """The delay before retry `attempt` (0: the first), before jitter."""
    return min(FIRST_BACKOFF_S * float(2 ** min(attempt, _DOUBLINGS)), MAX_BACKOFF_S)


def jittered(delay: float, rng: random.Random) -> float:
    """`delay` scaled by a factor drawn uniformly from 0.5 to 1.5."""
    return delay * rng.uniform(0.5, 1.5)
