"""Session tickets in Redis, shared by every server process and replica of a deployment.

Single use holds everywhere because redemption is one atomic GETDEL; the TTL is Redis's own key
expiry, so it holds across hosts too. Entries are sealed (service/tickets/seal.py): Redis holds
neither labels nor usable resumption secrets, and each entry's expiry is sealed with it, so an
entry whose TTL was raised in Redis, or one put back after it was redeemed, opens only until the
expiry it was issued with (the servers' clocks must agree).

aioquic calls `add` and `pop` synchronously from the packet path, so each Redis call blocks the
event loop for one round trip. That is bounded: the socket timeout is short (`timeout_s`) and
redis-py's retries are off. After a failure the store is treated as down for `retry_after_s`:
meanwhile it answers without touching the network, refusing every ticket (full handshakes, no
0-RTT) and storing none, so an unreachable Redis costs at most one timeout per `retry_after_s`,
not one per connection. Only the server imports this module (redis is in the `server` extra).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis
from aioquic.tls import SessionTicket
from redis.backoff import NoBackoff
from redis.retry import Retry

from service.tickets.outage import StoreOutage
from service.tickets.seal import TicketSealer, redeem
from transport.tls.session_tickets import DEFAULT_TTL_S, TicketCounters

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 0.05
DEFAULT_RETRY_AFTER_S = 5.0


class RedisTicketStore:
    def __init__(
        self,
        client: redis.Redis,
        sealer: TicketSealer,
        ttl_s: float = DEFAULT_TTL_S,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock` times the back-off; `wall_clock` the sealed expiry, which every server
        sharing the store compares."""
        self.client = client
        self.sealer = sealer
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.wall_clock = wall_clock
        self.counters = TicketCounters()
        self._down_until: float | None = None
        self._outage = StoreOutage(
            log,
            "ticket store unreachable (%s): 0-RTT off, full handshakes only; retrying every %.0f s",
            "ticket store reachable again: 0-RTT back on",
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        sealer: TicketSealer,
        ttl_s: float = DEFAULT_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> RedisTicketStore:
        """`redis://[[USER]:PASSWORD@]HOST:PORT/DB` or `rediss://` (TLS)."""
        client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        return cls(client, sealer, ttl_s)

    @property
    def available(self) -> bool:
        return self._down_until is None or self.clock() >= self._down_until

    def check(self) -> bool:
        """One PING, so an unreachable Redis is reported when the server starts."""
        if not self.available:
            return False
        try:
            self.client.ping()
        except redis.RedisError as exc:
            self._failed(exc)
            return False
        return True

    def add(self, ticket: SessionTicket) -> None:
        if not self.available:
            return
        name, sealed = self.sealer.seal(ticket, self.wall_clock() + self.ttl_ms / 1000)
        try:
            self.client.set(name, sealed, px=self.ttl_ms)
        except redis.RedisError as exc:
            self._failed(exc)
            return
        self._recovered()
        self.counters.issued += 1

    def pop(self, label: bytes) -> SessionTicket | None:
        if not self.available:
            self.counters.refused += 1
            return None
        try:
            sealed = self.client.getdel(self.sealer.name(label))
        except redis.RedisError as exc:
            self._failed(exc)
            self.counters.refused += 1
            return None
        self._recovered()
        found = sealed if isinstance(sealed, bytes) else None
        return redeem(self.sealer, label, found, self.wall_clock(), self.counters)

    def _failed(self, exc: Exception) -> None:
        self._outage.failed(exc, self.retry_after_s)
        self._down_until = self.clock() + self.retry_after_s

    def _recovered(self) -> None:
        self._outage.recovered()
        self._down_until = None
