"""Session tickets in a SQLite file: one store for the server processes of one host.

Redemption is one `DELETE ... RETURNING` statement, atomic across processes, so a ticket is
single use among all of them; expiry is a column checked on redemption and purged as tickets are
added. Entries are sealed like Redis's (service/tickets/seal.py), so the file never holds a
usable resumption secret either, and each entry's expiry is sealed with it. Whoever can write
the file can put a redeemed ticket back (it then works again until its sealed expiry), so the
store must be this user's alone: its directory writable by no other user, the file and SQLite's
side files (`-wal`, `-shm`) owned by this user and made 0600, or the server refuses to start.

aioquic calls `add` and `pop` synchronously from the packet path: a local SQLite statement takes
microseconds, and a lock held by another process is waited for at most `busy_timeout_s`, after
which the ticket is refused (full handshake) or not stored.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import time
from collections.abc import Callable
from pathlib import Path

from aioquic.tls import SessionTicket

from service.tickets.outage import StoreOutage
from service.tickets.seal import TicketSealer, redeem
from transport.tls.session_tickets import DEFAULT_MAX_TICKETS, DEFAULT_TTL_S, TicketCounters

log = logging.getLogger(__name__)

DEFAULT_BUSY_TIMEOUT_S = 0.05
# Expired and surplus tickets are purged every this many adds of one process, so the file stays
# bounded (max_tickets plus what the processes added since their last purge) at little cost.
PURGE_EVERY = 256
# SQLite creates these next to the database with the database's mode; they hold tickets too.
SIDE_FILES = ("-wal", "-shm", "-journal")

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
        self._outage = StoreOutage(
            log,
            "ticket store failing (%s): those clients get full handshakes",
            "ticket store working again",
        )
        claim_private(path)
        # Autocommit: every statement is its own transaction. WAL lets readers and the writer
        # overlap; losing the last tickets in a power cut costs clients one full handshake.
        self._db = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.executescript(_SCHEMA)

    def add(self, ticket: SessionTicket) -> None:
        now = self.clock()
        expires = now + self.ttl_s
        name, sealed = self.sealer.seal(ticket, expires)
        try:
            self._db.execute(
                "INSERT OR REPLACE INTO tickets VALUES (?, ?, ?)", (name, expires, sealed)
            )
            self._adds += 1
            if self._adds % PURGE_EVERY == 0:
                self._purge(now)
        except sqlite3.Error as exc:
            self._outage.failed(exc)
            return
        self._outage.recovered()
        self.counters.issued += 1

    def pop(self, label: bytes) -> SessionTicket | None:
        try:
            row = self._db.execute(
                "DELETE FROM tickets WHERE name = ? RETURNING expires, sealed",
                (self.sealer.name(label),),
            ).fetchone()
        except sqlite3.Error as exc:
            self._outage.failed(exc)
            self.counters.refused += 1
            return None
        self._outage.recovered()
        now = self.clock()
        live = row is not None and row[0] > now
        return redeem(self.sealer, label, row[1] if live else None, now, self.counters)

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


def claim_private(path: Path) -> None:
    """Create the store file 0600, or make the existing one and its side files 0600; refuse
    them (PermissionError, saying how to fix it) where another user could write them."""
    directory = path.parent
    info = os.stat(directory)
    if info.st_uid not in (os.geteuid(), 0) or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"{directory} (mode {stat.S_IMODE(info.st_mode):04o}, uid {info.st_uid}) lets other "
            "users replace the ticket store, and whoever writes it can put redeemed tickets "
            "back: keep it in a directory only this user can write (chmod go-w, or e.g. "
            "/var/lib/paddlequic with mode 0700)"
        )
    _make_private(path, create=True)
    for suffix in SIDE_FILES:
        _make_private(path.with_name(path.name + suffix), create=False)


def _make_private(path: Path, create: bool) -> None:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        if create:
            raise
        return
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise PermissionError(
                f"{path} is not a file of this server's user (uid {os.geteuid()}; it is uid "
                f"{info.st_uid}): another user could put redeemed tickets back in it; remove it "
                "or give it to this user"
            )
        mode = stat.S_IMODE(info.st_mode)
        if mode != 0o600:
            log.warning("ticket store %s had mode %04o: made it 0600", path, mode)
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
