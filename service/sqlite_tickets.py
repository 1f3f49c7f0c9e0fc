"""Session tickets in a SQLite file: one store for the server processes of one host.

Redemption is one `DELETE ... RETURNING` statement, atomic across processes, so a ticket is
single use among all of them; expiry is a column checked on redemption and purged as tickets are
added. Entries are sealed like Redis's (transport/ticket_seal.py), so the file never holds a
usable resumption secret either. aioquic calls `add` and `pop` synchronously from the packet
path: a local SQLite statement takes microseconds, and a lock held by another process is waited
for at most `busy_timeout_s`, after which the ticket is refused (full handshake) or not stored.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from aioquic.tls import SessionTicket

from transport.ticket_seal import TicketSealer, redeem
from transport.tickets import DEFAULT_MAX_TICKETS, DEFAULT_TTL_S, TicketCounters

log = logging.getLogger(__name__)

DEFAULT_BUSY_TIMEOUT_S = 0.05
# Expired and surplus tickets are purged every this many adds of one process, so the file stays
# bounded (max_tickets plus what the processes added since their last purge) at little cost.
PURGE_EVERY = 256

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tickets (
    name BLOB PRIMARY KEY,
    expires REAL NOT NULL,
    sealed BLOB NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tickets_expires ON tickets (expires);
"""


class SqliteTicketStore:
    def __init__(
        self,
        path: Path,
        sealer: TicketSealer,
        ttl_s: float = DEFAULT_TTL_S,
        max_tickets: int = DEFAULT_MAX_TICKETS,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sealer = sealer
        self.ttl_s = ttl_s
        self.max_tickets = max_tickets
        self.clock = clock  # wall clock: the processes sharing the file compare expiry times
        self.counters = TicketCounters()
        self._adds = 0
        self._failing = False
        path.touch(mode=0o600, exist_ok=True)
        # Autocommit: every statement is its own transaction. WAL lets readers and the writer
        # overlap; losing the last tickets in a power cut costs clients one full handshake.
        self._db = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.executescript(_SCHEMA)

    def add(self, ticket: SessionTicket) -> None:
        name, sealed = self.sealer.seal(ticket)
        now = self.clock()
        try:
            self._db.execute(
                "INSERT OR REPLACE INTO tickets VALUES (?, ?, ?)", (name, now + self.ttl_s, sealed)
            )
            self._adds += 1
            if self._adds % PURGE_EVERY == 0:
                self._purge(now)
        except sqlite3.Error as exc:
            self._failed(exc)
            return
        self._recovered()
        self.counters.issued += 1

    def pop(self, label: bytes) -> SessionTicket | None:
        try:
            row = self._db.execute(
                "DELETE FROM tickets WHERE name = ? RETURNING expires, sealed",
                (self.sealer.name(label),),
            ).fetchone()
        except sqlite3.Error as exc:
            self._failed(exc)
            self.counters.refused += 1
            return None
        self._recovered()
        live = row is not None and row[0] > self.clock()
        return redeem(self.sealer, label, row[1] if live else None, self.counters)

    def _purge(self, now: float) -> None:
        self._db.execute("DELETE FROM tickets WHERE expires <= ?", (now,))
        surplus = self._db.execute("SELECT count(*) FROM tickets").fetchone()[0] - self.max_tickets
        if surplus > 0:
            self._db.execute(
                "DELETE FROM tickets WHERE name IN "
                "(SELECT name FROM tickets ORDER BY expires LIMIT ?)",
                (surplus,),
            )
            self.counters.evicted += surplus

    def _failed(self, exc: Exception) -> None:
        if not self._failing:
            log.warning("ticket store failing (%s): those clients get full handshakes", exc)
            self._failing = True

    def _recovered(self) -> None:
        if self._failing:
            log.warning("ticket store working again")
            self._failing = False
