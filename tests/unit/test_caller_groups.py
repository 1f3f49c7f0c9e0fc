"""The groups a shared-memory caller's uid has (service/dataplane/shared_memory.py `_groups`):
the user database's answer, kept GROUPS_FOR_S, for at most MAX_UIDS_KNOWN uids at once."""

from __future__ import annotations

import os
import pwd
import time

import pytest

from service.dataplane import shared_memory
from service.dataplane.shared_memory import MAX_UIDS_KNOWN, _groups


def test_a_uids_groups_are_the_databases_and_kept_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    monkeypatch.setattr(shared_memory, "_known_groups", {})
    root = pwd.getpwuid(0)
    assert _groups(0) == frozenset(os.getgrouplist(root.pw_name, root.pw_gid))
    read: list[int] = []

    def getpwuid(uid: int) -> pwd.struct_passwd:
        read.append(uid)
        return root

    monkeypatch.setattr(pwd, "getpwuid", getpwuid)
    _groups(0)
    assert read == []  # kept
    now[0] += shared_memory.GROUPS_FOR_S
    _groups(0)
    assert read == [0]  # read again once its time is up


def test_the_uids_known_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_memory, "_known_groups", {})
    unknown = 3_000_000_000  # no user database has these
    for uid in range(unknown, unknown + MAX_UIDS_KNOWN + 40):
        assert _groups(uid) == frozenset()
    assert len(shared_memory._known_groups) == MAX_UIDS_KNOWN
    assert unknown not in shared_memory._known_groups  # the oldest went first
