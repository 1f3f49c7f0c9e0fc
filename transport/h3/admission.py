"""Which new connections an HTTP/3 server takes, decided before any state exists for one, and
the counts that decision reads: its own, and those of the other processes on its port."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from aioquic.quic.connection import NetworkAddress

from transport.h3.aioquic.quic_server import Admission
from transport.h3.receive_budget import DEFAULT_PER_ADDRESS, DEFAULT_TOTAL
from transport.host_tally import ScopedTally

# What an H3Server counts in a ScopedTally (`host`), read by the other processes on its port.
CONNECTIONS, HALF_OPEN, RPCS, RECEIVED = range(4)
COUNTERS = 4
CONNECTIONS_COLUMN, RECEIVED_COLUMN = range(2)  # per address
COLUMNS = 2


class RetryMode(Enum):
    """When a new connection must first prove its address with a QUIC Retry (one more round
    trip): `auto` only while many connections are half-open (a flood of Initials, possibly
    from spoofed addresses)."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


@dataclass(frozen=True)
class H3Limits:
    """What one server holds for connections it did not choose: all bounded."""

    max_connections: int = 1024
    max_connections_per_address: int = 64
    handshake_timeout_s: float = 10.0
    retry: RetryMode = RetryMode.AUTO
    retry_above_half_open: int = 64  # auto: Retry while this many handshakes are unfinished
    # Bytes request streams may hold (received, not yet consumed), reserved per address and in
    # total across this server's connections (transport/h3/receive_budget.py).
    receive_budget_per_address: int = DEFAULT_PER_ADDRESS
    receive_budget_total: int = DEFAULT_TOTAL


class ConnectionAdmission:
    """The connections one server holds (per address, and those whose handshake has not
    completed) and the decision on each new one against `limits`, counting what the other
    processes on the port hold too (`host`; None: this process is alone). A policy without
    I/O: the server tells it what opened, finished and closed, and publishes the counts."""

    def __init__(
        self, limits: H3Limits, host: ScopedTally | None, refused: Callable[[str], None]
    ) -> None:
        """`refused(kind)`: counts a refusal ("connections", "connections_per_address",
        "retry")."""
        self.limits = limits
        self._host = host
        self._refused = refused
        self.held = 0
        self.unfinished = 0  # held connections whose handshake has not completed
        self.per_address: Counter[str] = Counter()
        self._admitted = ""  # the address of the connection being created

    def decide(self, address: NetworkAddress, validated: bool) -> Admission:
        """`validated`: its Initial carries a Retry token (checked next) or a valid NEW_TOKEN
        token."""
        host = str(address[0])
        limits, elsewhere = self.limits, self._host
        connections = self.held
        of_address = self.per_address[host]
        if elsewhere is not None:
            connections += elsewhere.others(CONNECTIONS)
            of_address += elsewhere.others_at(host)[CONNECTIONS_COLUMN]
            if not self.per_address[host] and not elsewhere.room():
                connections = limits.max_connections  # more addresses than it counts: refused
        if connections >= limits.max_connections:
            self._refused("connections")
            return Admission.REFUSE
        if of_address >= limits.max_connections_per_address:
            self._refused("connections_per_address")
            return Admission.REFUSE
        if not validated and (
            limits.retry is RetryMode.ALWAYS
            or (
                limits.retry is RetryMode.AUTO
                and self.unfinished + (0 if elsewhere is None else elsewhere.others(HALF_OPEN))
                >= limits.retry_above_half_open
            )
        ):
            self._refused("retry")
            return Admission.RETRY
        self._admitted = host
        return Admission.ACCEPT

    def opened(self) -> str:
        """The connection just accepted now exists; returns the address it was admitted for."""
        address, self._admitted = self._admitted, ""
        self.held += 1
        self.per_address[address] += 1
        self.unfinished += 1
        return address

    def handshake_finished(self) -> None:
        self.unfinished -= 1

    def closed(self, address: str, unfinished: bool) -> None:
        """`unfinished`: it never completed its handshake."""
        self.held -= 1
        self.unfinished -= unfinished
        self.per_address[address] -= 1
        if not self.per_address[address]:
            del self.per_address[address]

    def publish(self, address: str, received: int) -> None:
        """Its counts where the other processes on the port read them, and `address`'s
        connections with the bytes its streams hold (`received`) ("": no address changed)."""
        host = self._host
        if host is None:
            return
        host.set(CONNECTIONS, self.held)
        host.set(HALF_OPEN, self.unfinished)
        if address:
            self.publish_address(address, received)

    def publish_address(self, address: str, received: int) -> None:
        """`address`'s connections and bytes alone: what a stream's reservation changes."""
        if self._host is not None:
            self._host.set_at(address, (self.per_address.get(address, 0), received))
