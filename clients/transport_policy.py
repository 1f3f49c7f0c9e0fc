"""Where an auto:// channel's new calls go: HTTP/2 until an HTTP/2 response advertised HTTP/3
(`alt-svc`), HTTP/3 while that advertisement is fresh, and HTTP/2 again for the advertised
lifetime after HTTP/3 failed to connect (UDP blocked on this network). Free of asyncio, with an
injectable clock, so its decisions are tested with explicit times; `AutoChannel` drives it."""

from __future__ import annotations

import time
from collections.abc import Callable

from transport.grpc.alt_svc import Alternative, parse_h3

# However long a server says, a client re-checks at least daily (RFC 7838's default `ma`).
MAX_REMEMBERED_S = 86400.0


class TransportPolicy:
    """What one client knows of one origin; channels of a process may share it (as they share
    a ticket cache), so a new connection starts where the last one ended."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._alternative: Alternative | None = None
        self._expires = 0.0
        self._blocked_until: float | None = None

    def learn(self, alt_svc: str) -> None:
        """An HTTP/2 response's `alt-svc` value replaces what was known (RFC 7838 section 3):
        `clear`, or a value naming no HTTP/3 alternative, forgets it."""
        self._alternative = parse_h3(alt_svc)
        if self._alternative is not None:
            self._expires = self._clock() + self._lifetime(self._alternative)

    def h3_endpoint(self, origin_host: str) -> tuple[str, int] | None:
        """Where new calls should try HTTP/3 now; None: HTTP/2 (nothing fresh is known, or a
        failure is remembered)."""
        now = self._clock()
        if self._alternative is None or now >= self._expires:
            return None
        if self._blocked_until is not None and now < self._blocked_until:
            return None
        return (self._alternative.host or origin_host, self._alternative.port)

    def h3_failed(self) -> None:
        """HTTP/3 did not complete its handshake: stay on HTTP/2 for the advertised lifetime."""
        if self._alternative is not None:
            self._blocked_until = self._clock() + self._lifetime(self._alternative)

    def h3_worked(self) -> None:
        self._blocked_until = None

    @property
    def blocked_until(self) -> float | None:
        """When a remembered HTTP/3 failure expires (the clock's time), if one is remembered."""
        if self._blocked_until is None or self._clock() >= self._blocked_until:
            return None
        return self._blocked_until

    @staticmethod
    def _lifetime(alternative: Alternative) -> float:
        return min(float(alternative.max_age_s), MAX_REMEMBERED_S)
