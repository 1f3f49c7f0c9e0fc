"""The SQLite ticket store counts what it issues, redeems and refuses (what the server's ticket
metrics report): `make mutate` found `issued` unchecked."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_sqlite_tickets import store
from tests.unit.test_tickets import ticket


def test_issued_redeemed_and_refused_are_counted(tmp_path: Path) -> None:
    tickets = store(tmp_path / "tickets.db")
    for label in (b"a", b"b", b"c"):
        tickets.add(ticket(label))
    assert tickets.pop(b"a") is not None
    assert tickets.pop(b"a") is None and tickets.pop(b"unknown") is None
    counters = tickets.counters
    assert (counters.issued, counters.redeemed, counters.refused) == (3, 1, 2)
