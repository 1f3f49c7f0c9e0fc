"""The host-local shared ticket store: single use across real processes, TTL, bounds, sealing
on disk, and a locked database refusing tickets instead of blocking."""

from __future__ import annotations

import logging
import multiprocessing
import sqlite3
import stat
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from service import sqlite_tickets
from service.sqlite_tickets import SqliteTicketStore
from service.ticket_store import TicketStoreError, open_ticket_store
from tests.unit.test_tickets import FakeClock, ticket
from transport.ticket_seal import TicketSealer

KEY = bytes(range(32))
LABELS = [f"t{i}".encode() for i in range(200)]


def store(path: Path, **kw: object) -> SqliteTicketStore:
    return SqliteTicketStore(path, TicketSealer(KEY), **kw)  # type: ignore[arg-type]


def redeem_all(path: Path) -> list[bytes]:
    """In another process: every label this process managed to redeem."""
    own = store(path)
    return [label for label in LABELS if own.pop(label) is not None]


def test_each_ticket_is_redeemed_by_exactly_one_process(tmp_path: Path) -> None:
    path = tmp_path / "tickets.db"
    issuer = store(path)
    for label in LABELS:
        issuer.add(ticket(label))
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        first, second = pool.map(redeem_all, [path, path])
    assert sorted(first + second) == sorted(LABELS)
    assert not set(first) & set(second)
    assert issuer.pop(LABELS[0]) is None


def test_tickets_expire_and_the_file_stays_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_tickets, "PURGE_EVERY", 4)
    clock = FakeClock()
    path = tmp_path / "tickets.db"
    tickets = store(path, ttl_s=60, max_tickets=2, clock=clock)
    tickets.add(ticket(b"stale"))
    clock.now += 61
    for label in (b"a", b"b", b"c"):
        clock.now += 1
        tickets.add(ticket(label))  # the fourth add purges: expired, then the oldest surplus
    assert tickets.counters.evicted == 1
    assert sqlite3.connect(path).execute("SELECT count(*) FROM tickets").fetchone() == (2,)
    assert [tickets.pop(label) is not None for label in (b"stale", b"a", b"b", b"c")] == [
        False,
        False,
        True,
        True,
    ]
    clock.now += 61
    tickets.add(ticket(b"late"))
    clock.now += 61
    assert tickets.pop(b"late") is None  # expired at redemption, before any purge


def test_the_file_is_private_and_holds_no_secret(tmp_path: Path) -> None:
    path = tmp_path / "tickets.db"
    stored = ticket(b"visible-label")
    store(path).add(stored)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    on_disk = b"".join(p.read_bytes() for p in tmp_path.iterdir())  # the WAL file too
    assert stored.resumption_secret not in on_disk
    assert b"visible-label" not in on_disk


def test_a_locked_database_refuses_instead_of_blocking(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tickets.db"
    tickets = store(path, busy_timeout_s=0.01)
    kept = ticket(b"kept")
    tickets.add(kept)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    with caplog.at_level(logging.WARNING):
        tickets.add(ticket(b"lost"))
        assert tickets.pop(b"kept") is None  # that client gets a full handshake
    assert caplog.text.count("ticket store failing") == 1
    other.execute("ROLLBACK")
    other.close()
    assert tickets.pop(b"kept") == kept
    assert tickets.pop(b"lost") is None


def test_sqlite_store_configuration(tmp_path: Path) -> None:
    key = tmp_path / "ticket.key"
    key.write_bytes(KEY)
    path = tmp_path / "tickets.db"
    opened = open_ticket_store(f"sqlite://{path}", str(key), 60)
    assert isinstance(opened, SqliteTicketStore)
    with pytest.raises(TicketStoreError, match="needs --ticket-key-file"):
        open_ticket_store(f"sqlite://{path}", "", 60)
    with pytest.raises(TicketStoreError, match="sqlite://"):
        open_ticket_store(f"sqlite://{tmp_path / 'missing' / 'tickets.db'}", str(key), 60)
