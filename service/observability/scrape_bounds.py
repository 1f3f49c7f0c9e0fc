"""What the /metrics listener holds for its peers, bounded: connections at once, and the time
each may stay open. Its HTTP server answers each connection in a thread of its own and reads
without a timeout, so before these bounds a peer that connected and sent nothing (or a byte
now and then) held a thread of the server's process for as long as it liked, and a thousand
such peers a thousand threads: with `--metrics-host 0.0.0.0`, as the Kubernetes manifests
have it, anyone who can reach the port. A connection past the bound is closed as soon as it
is accepted; one open past its time is shut, whatever it was doing (reading its request or
being sent its answer), which ends its thread.

A pure decision with an explicit clock, as CircuitBreaker's: the listener's loop asks it."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

DEFAULT_MAX_CONNECTIONS = 16
DEFAULT_TIMEOUT_S = 10.0  # Prometheus's own scrape timeout by default
Connection = TypeVar("Connection", bound=Hashable)


@dataclass(frozen=True)
class ScrapeLimits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # held at once, in all (one listener per host)
    timeout_s: float = DEFAULT_TIMEOUT_S  # per connection: its request read, its answer sent

    def __post_init__(self) -> None:
        if self.max_connections < 1 or not self.timeout_s > 0:
            raise ValueError("a /metrics listener holds at least one connection, for some time")


class ScrapeConnections(Generic[Connection]):
    """The connections held now, each with the time it must be closed by."""

    def __init__(self, limits: ScrapeLimits) -> None:
        self._limits = limits
        self._deadlines: dict[Connection, float] = {}

    def __len__(self) -> int:
        return len(self._deadlines)

    def admit(self, connection: Connection, now: float) -> bool:
        """Whether a connection accepted at `now` is held (False: close it at once)."""
        if len(self._deadlines) >= self._limits.max_connections:
            return False
        self._deadlines[connection] = now + self._limits.timeout_s
        return True

    def ended(self, connection: Connection) -> None:
        """It was closed (one never admitted, or expired before, is no error)."""
        self._deadlines.pop(connection, None)

    def expired(self, now: float) -> list[Connection]:
        """Those past their time at `now`: no longer held, each to be shut."""
        gone = [c for c, deadline in self._deadlines.items() if deadline <= now]
        for connection in gone:
            del self._deadlines[connection]
        return gone

    def next_deadline(self) -> float | None:
        """When expired() next has one to give (None: nothing is held)."""
        return min(self._deadlines.values(), default=None)
