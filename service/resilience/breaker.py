"""A circuit breaker per model version: when most recent executions failed on the server's
side, callers are answered at once (or by a fallback model) instead of each waiting for the
broken model until its deadline.

Kept free of asyncio, with an injectable clock, so its decisions are tested with explicit
times. It counts what reached the caller, never the retries inside (the batcher requeues a
batch whose worker died; only the final outcome is recorded here)."""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from service.model.parameters import BreakerPolicy

# Server-side failures; a caller's INVALID_ARGUMENT (or a full queue, or a cancel) says nothing
# about the model's health.
FAILURE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}
)
HALF_OPEN_PROBES = 3  # requests let through at once after the cool-down


class BreakerState(enum.Enum):
    CLOSED = "CLOSED"
    OPEN = "OPEN"
    HALF_OPEN = "HALF_OPEN"


# How much a state tells a caller's operator, least first: where processes' breakers of one
# version differ, the server shows the one that tells most.
_SEVERITY = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}

Shown = tuple[BreakerState, float]  # a state and the seconds until its next probe


def worst(shown: Iterable[Shown]) -> Shown:
    """The state of several breakers of one version (each process holding calls keeps its
    own): OPEN if any is, else HALF_OPEN if any is, else CLOSED; the longest wait of those in
    it."""
    found: Shown = (BreakerState.CLOSED, 0.0)
    for state, retry_in_s in shown:
        if _SEVERITY[state] > _SEVERITY[found[0]]:
            found = (state, retry_in_s)
        elif state is found[0]:
            found = (state, max(found[1], retry_in_s))
    return found


@dataclass(frozen=True)
class Admission:
    probe: bool  # a half-open probe: its outcome closes or reopens the breaker


class CircuitBreaker:
    def __init__(self, policy: BreakerPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        # Per second of the window: [second, requests, failures]. Memory stays bounded by the
        # window's length, whatever the request rate.
        self._seconds: collections.deque[list[int]] = collections.deque()
        self._requests = 0
        self._failures = 0
        self._open_until: float | None = None
        self._probes = 0

    @property
    def state(self) -> BreakerState:
        if self._open_until is None:
            return BreakerState.CLOSED
        if self._clock() < self._open_until:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def retry_in_s(self) -> float:
        """Seconds until the next probe may go through (0 unless open)."""
        if self._open_until is None:
            return 0.0
        return max(self._open_until - self._clock(), 0.0)

    def admit(self) -> Admission | None:
        """None: refused (open, or half-open with its probes all out)."""
        state = self.state
        if state is BreakerState.CLOSED:
            return Admission(probe=False)
        if state is BreakerState.HALF_OPEN and self._probes < HALF_OPEN_PROBES:
            self._probes += 1
            return Admission(probe=True)
        return None

    def record(self, admission: Admission, code: grpc.StatusCode | None) -> None:
        """The outcome that reached the caller: None for success."""
        failed = code in FAILURE_CODES
        if admission.probe:
            self._probes -= 1
            if failed:
                self.trip()
            elif code is None:
                self._close()
            return
        if code is not None and not failed:
            return
        if self._open_until is not None:  # a request admitted before the breaker opened
            return
        now = self._clock()
        second = int(now)
        if not self._seconds or self._seconds[-1][0] != second:
            self._seconds.append([second, 0, 0])
        self._seconds[-1][1] += 1
        self._seconds[-1][2] += failed
        self._requests += 1
        self._failures += failed
        while self._seconds and self._seconds[0][0] <= now - self.policy.window_s:
            _, requests, failures = self._seconds.popleft()
            self._requests -= requests
            self._failures -= failures
        enough = self._requests >= self.policy.min_requests
        if enough and self._failures >= self.policy.failure_ratio * self._requests:
            self.trip()

    def trip(self) -> None:
        """Open now (again): nothing gets through until the cool-down has passed."""
        self._open_until = self._clock() + self.policy.open_s
        self._forget()

    def _close(self) -> None:
        self._open_until = None
        self._forget()

    def _forget(self) -> None:
        self._seconds.clear()
        self._requests = 0
        self._failures = 0
