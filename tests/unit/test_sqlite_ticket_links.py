"""The SQLite ticket store never follows a symbolic link to its file: whoever can place a link
could point the server at a file of theirs and put redeemed tickets back. `make mutate` found
no test for the O_NOFOLLOW of service/tickets/sqlite_store.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_sqlite_tickets import store
from tests.unit.test_tickets import ticket


@pytest.mark.parametrize("side", ["", "-wal"])
def test_a_store_file_that_is_a_symbolic_link_is_refused(tmp_path: Path, side: str) -> None:
    path = tmp_path / "tickets.db"
    if side:
        store(path).add(ticket(b"a"))  # the store exists; now its side file is a link
        path.with_name(path.name + side).unlink(missing_ok=True)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    target.chmod(0o600)
    path.with_name(path.name + side).symlink_to(target)
    with pytest.raises(OSError):
        store(path)
