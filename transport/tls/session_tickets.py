"""Server-side TLS session tickets for resumption and 0-RTT.

Tickets are single use: fetching one removes it, so replayed early data finds no ticket and gets
a full handshake with its early data rejected. aioquic never checks a ticket's age, so the store
does (TTL), and it is bounded (oldest evicted). One process's memory is enough for one server;
several server processes or replicas behind one address need a shared store with an atomic
get-and-delete, which is what the `TicketStore` protocol asks for (the server has one on Redis).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from aioquic.tls import SessionTicket

DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_TICKETS = 100_000


@dataclass
class TicketCounters:
    issued: int = 0
    redeemed: int = 0
    refused: int = 0  # unknown, expired or replayed: that client gets a full handshake
    evicted: int = 0


class TicketStore(Protocol):
    counters: TicketCounters

    def add(self, ticket: SessionTicket) -> None: ...

    def pop(self, label: bytes) -> SessionTicket | None:
        """Remove and return the ticket, or None if unknown, expired or already used."""


@dataclass
class MemoryTicketStore:
    ttl_s: float = DEFAULT_TTL_S
    max_tickets: int = DEFAULT_MAX_TICKETS
    clock: Callable[[], float] = time.monotonic
    counters: TicketCounters = field(default_factory=TicketCounters)
    _tickets: collections.OrderedDict[bytes, tuple[float, SessionTicket]] = field(
        default_factory=collections.OrderedDict
    )
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, ticket: SessionTicket) -> None:
        with self._lock:
            self._tickets[ticket.ticket] = (self.clock() + self.ttl_s, ticket)
            self.counters.issued += 1
            while len(self._tickets) > self.max_tickets:
                self._tickets.popitem(last=False)
                self.counters.evicted += 1

    def pop(self, label: bytes) -> SessionTicket | None:
        with self._lock:
            entry = self._tickets.pop(label, None)
            if entry is None or entry[0] <= self.clock():
                self.counters.refused += 1
                return None
            self.counters.redeemed += 1
            return entry[1]

    def __len__(self) -> int:
        return len(self._tickets)
