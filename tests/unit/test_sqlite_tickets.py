"""The host-local shared ticket store: single use across real processes, TTL, bounds, sealing
on disk, and a locked database refusing tickets instead of blocking."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sqlite3
import stat
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from service.tickets import sqlite_store
from service.tickets.seal import TicketSealer
from service.tickets.sqlite_store import SqliteTicketStore
from service.tickets.store import TicketStoreError, open_ticket_store
from tests.unit.test_tickets import FakeClock, ticket

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
    monkeypatch.setattr(sqlite_store, "PURGE_EVERY", 4)
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
        assert "ticket store failing" in caplog.text  # the add alone says so
        assert tickets.pop(b"kept") is None  # that client gets a full handshake
    assert caplog.text.count("ticket store failing") == 1
    other.execute("ROLLBACK")
    other.close()
    with caplog.at_level(logging.WARNING):
        tickets.add(ticket(b"new"))
    assert "ticket store working again" in caplog.text  # the add that worked says so
    assert tickets.pop(b"kept") == kept
    assert tickets.pop(b"lost") is None


def test_sqlite_store_configuration(tmp_path: Path) -> None:
    key = tmp_path / "ticket.key"
    key.write_bytes(KEY)
    key.chmod(0o600)
    path = tmp_path / "tickets.db"
    opened = open_ticket_store(f"sqlite://{path}", str(key), 60)
    assert isinstance(opened, SqliteTicketStore)
    with pytest.raises(TicketStoreError, match="needs --ticket-key-file"):
        open_ticket_store(f"sqlite://{path}", "", 60)
    with pytest.raises(TicketStoreError, match="sqlite://"):
        open_ticket_store(f"sqlite://{tmp_path / 'missing' / 'tickets.db'}", str(key), 60)


def modes(*paths: Path) -> list[str]:
    return [f"{stat.S_IMODE(p.stat().st_mode):04o}" for p in paths]


def test_the_store_and_its_side_files_are_made_private(tmp_path: Path) -> None:
    """Created 0600 whatever the umask, SQLite's -wal and -shm following; an existing store
    of mode 0666 and its side files are made 0600 when a server opens it."""
    path = tmp_path / "tickets.db"
    sides = [path.with_name(path.name + suffix) for suffix in ("-wal", "-shm")]
    umask = os.umask(0)
    try:
        first = store(path)
        first.add(kept := ticket(b"a"))
    finally:
        os.umask(umask)
    assert modes(path, *sides) == ["0600"] * 3
    for file in (path, *sides):
        file.chmod(0o666)
    second = store(path)
    assert modes(path, *sides) == ["0600"] * 3
    assert second.pop(b"a") == kept


def test_a_store_other_users_can_write_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "ticket.key"
    key.write_bytes(KEY)
    key.chmod(0o600)
    shared = tmp_path / "shared"
    shared.mkdir()
    for mode in (0o777, 0o1777, 0o770):  # sticky or not: side files could be planted there
        shared.chmod(mode)
        with pytest.raises(TicketStoreError, match=f"mode {mode:04o}.*chmod go-w"):
            open_ticket_store(f"sqlite://{shared / 'tickets.db'}", str(key), 60)
    assert not (shared / "tickets.db").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
@pytest.mark.parametrize(
    ("owned", "message"),
    [
        ("tickets.db", "not a file of this server's user"),
        ("tickets.db-wal", "not a file of this server's user"),
        ("tickets.db-shm", "not a file of this server's user"),
        (".", "uid 65534.*lets other users replace the ticket store"),
    ],
)
def test_a_store_another_user_owns_is_refused(tmp_path: Path, owned: str, message: str) -> None:
    """The file, a side file, or the directory holding them."""
    path = tmp_path / "store" / "tickets.db"
    path.parent.mkdir(mode=0o700)
    # Kept open: SQLite removes the -wal and -shm files when the last connection closes, which
    # a collected store would do at any moment, before or after the chown.
    first = store(path)
    first.add(ticket(b"a"))
    os.chown(path.parent / owned, 65534, 65534)
    with pytest.raises(PermissionError, match=message):
        store(path)


def test_the_expiry_is_sealed_so_an_edited_row_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A row whose expiry was pushed out, or a redeemed ticket put back, opens only until the
    expiry it was issued with."""
    clock = FakeClock()
    path = tmp_path / "tickets.db"
    tickets = store(path, ttl_s=60, clock=clock)
    tickets.add(edited := ticket(b"edited"))
    db = sqlite3.connect(path, isolation_level=None)
    row = db.execute("SELECT name, expires, sealed FROM tickets").fetchone()
    assert tickets.pop(b"edited") == edited
    db.execute("INSERT INTO tickets VALUES (?, ?, ?)", (row[0], row[1] + 1e6, row[2]))
    assert tickets.pop(b"edited") == edited  # put back: works until its expiry
    db.execute("INSERT INTO tickets VALUES (?, ?, ?)", (row[0], row[1] + 1e6, row[2]))
    clock.now += 60
    with caplog.at_level(logging.WARNING):
        assert tickets.pop(b"edited") is None
    assert "outlived its sealed expiry" in caplog.text
    assert (tickets.counters.redeemed, tickets.counters.refused) == (2, 1)


def test_surplus_tickets_are_purged_every_purge_every_adds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between purges the file may hold max_tickets plus what was added since the last one;
    the PURGE_EVERY-th add (and not before) brings it back to max_tickets."""
    monkeypatch.setattr(sqlite_store, "PURGE_EVERY", 4)
    clock = FakeClock()
    path = tmp_path / "tickets.db"
    tickets = store(path, max_tickets=1, clock=clock)
    seen = []
    for label in b"abcdefgh":
        clock.now += 1
        tickets.add(ticket(bytes([label])))
        rows = sqlite3.connect(path).execute("SELECT count(*) FROM tickets").fetchone()[0]
        seen.append((rows, tickets.counters.evicted))
    assert seen == [(1, 0), (2, 0), (3, 0), (1, 3), (2, 3), (3, 3), (4, 3), (1, 7)]
    assert tickets.pop(b"h") is not None  # the newest is kept


def test_a_redemption_that_fails_is_warned_and_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tickets.db"
    tickets = store(path, busy_timeout_s=0.01)
    tickets.add(kept := ticket(b"kept"))
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    with caplog.at_level(logging.WARNING):
        assert tickets.pop(b"kept") is None
    assert caplog.text.count("ticket store failing") == 1
    assert (tickets.counters.refused, tickets.counters.redeemed) == (1, 0)
    other.execute("ROLLBACK")
    other.close()
    with caplog.at_level(logging.WARNING):
        assert tickets.pop(b"kept") == kept
    assert "ticket store working again" in caplog.text


def test_a_new_store_is_created_private_not_made_private_afterwards(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Created 0600 by the open itself: no moment in which it had a wider mode (which would
    be warned about and fixed, as for an existing store)."""
    umask = os.umask(0)
    try:
        with caplog.at_level(logging.WARNING):
            store(tmp_path / "tickets.db")
    finally:
        os.umask(umask)
    assert "had mode" not in caplog.text
    assert modes(tmp_path / "tickets.db") == ["0600"]


def test_claiming_the_store_keeps_no_file_open(tmp_path: Path) -> None:
    path = tmp_path / "tickets.db"
    store(path).add(ticket(b"a"))  # the store and its side files exist
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        sqlite_store.claim_private(path)
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user takes root")
@pytest.mark.parametrize("uid", [1, 1000, 65534])
def test_a_store_directory_of_any_other_user_is_refused(tmp_path: Path, uid: int) -> None:
    """This user's or root's only (here they are the same)."""
    directory = tmp_path / "store"
    directory.mkdir(mode=0o700)
    os.chown(directory, uid, uid)
    with pytest.raises(PermissionError, match=f"uid {uid}.*lets other users replace"):
        store(directory / "tickets.db")


def test_a_ticket_redeemed_at_its_expiry_is_refused_as_expired_not_as_edited(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Expired at its expiry time: refused as any expired ticket is, not with the warning
    that says the store was edited."""
    clock = FakeClock()
    tickets = store(tmp_path / "tickets.db", ttl_s=60, clock=clock)
    tickets.add(ticket(b"due"))
    clock.now += 60
    with caplog.at_level(logging.WARNING):
        assert tickets.pop(b"due") is None
    assert "outlived its sealed expiry" not in caplog.text
    assert tickets.counters.refused == 1


def test_the_lock_wait_journal_and_purge_defaults(tmp_path: Path) -> None:
    """A lock is waited for at most 50 ms (docs/http3.md); the journal is a WAL (readers and
    the writer overlap) and no add waits for the disk (the packet path calls it; a power cut
    costs the last tickets' clients a full handshake); surplus tickets are purged every 256
    adds of a process."""
    tickets = store(tmp_path / "tickets.db", max_tickets=1)
    assert tickets._db.execute("PRAGMA busy_timeout").fetchone() == (50,)
    assert tickets._db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert tickets._db.execute("PRAGMA synchronous").fetchone() == (0,)  # OFF
    for label in range(255):
        tickets.add(ticket(b"%d" % label))
    assert tickets.counters.evicted == 0
    tickets.add(ticket(b"last"))
    assert tickets.counters.evicted == 255
