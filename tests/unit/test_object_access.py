"""Whether a uid could open a file itself (service/inference/object_access.py), with the
kernel as the oracle: for each drawn owner, group, mode, caller and access, a child process
that drops to the caller's uid and groups opens a real file, and the decision must agree."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.inference.object_access import Access, refusal

UIDS = st.sampled_from([1000, 1001, 65534])
GIDS = st.sampled_from([1000, 1001, 2000])
NEEDS = st.sampled_from([Access.READ, Access.WRITE, Access.READ | Access.WRITE])
_FLAGS = {Access.READ: os.O_RDONLY, Access.WRITE: os.O_WRONLY}


@pytest.fixture(scope="module")
def path() -> Iterator[Path]:
    made = Path("/dev/shm") / f"pq-access-{secrets.token_hex(4)}"
    made.write_bytes(b"x")
    yield made
    made.unlink()


def kernel_opens(path: Path, uid: int, gid: int, groups: frozenset[int], need: Access) -> bool:
    flags = _FLAGS.get(need, os.O_RDWR)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports by its exit status only
        try:
            os.setgroups(sorted(groups))
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            os.close(os.open(path, flags))
            os._exit(0)
        except PermissionError:
            os._exit(1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(child, 0)
    assert os.WEXITSTATUS(status) in (0, 1)
    return os.WEXITSTATUS(status) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="changing uid needs root")
@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    st_uid=UIDS,
    st_gid=GIDS,
    mode=st.integers(0, 0o777),
    uid=UIDS,
    groups=st.frozensets(GIDS),
    need=NEEDS,
)
def test_the_decision_is_the_kernels(
    path: Path,
    st_uid: int,
    st_gid: int,
    mode: int,
    uid: int,
    groups: frozenset[int],
    need: Access,
) -> None:
    os.chown(path, st_uid, st_gid)
    path.chmod(mode)
    # The process's primary gid is one of its groups; 3000 is nobody's group here.
    primary = min(groups, default=3000)
    allowed = refusal(uid, groups | {primary}, st_uid, st_gid, mode, need) is None
    assert allowed == kernel_opens(path, uid, primary, groups, need)


@given(
    st_uid=UIDS, st_gid=GIDS, mode=st.integers(0, 0o7777), groups=st.frozensets(GIDS), need=NEEDS
)
def test_root_may_open_anything(
    st_uid: int, st_gid: int, mode: int, groups: frozenset[int], need: Access
) -> None:
    assert refusal(0, groups, st_uid, st_gid, mode, need) is None


def test_a_refusal_says_who_may_not_do_what() -> None:
    assert refusal(65534, {65534}, 0, 0, 0o100600, Access.READ | Access.WRITE) == (
        "uid 65534, another user, may not read and write it (owner uid 0, group 0, mode 0600)"
    )
    assert refusal(1000, {1000}, 1000, 1000, 0o400, Access.WRITE) == (
        "uid 1000, its owner, may not write it (owner uid 1000, group 1000, mode 0400)"
    )
