"""Whether a user could open a file itself, by the file's owner, group and mode: the server
opens a caller's shared-memory object with its own credentials, so it uses the object for a
caller only as far as the caller could have opened it.

The kernel's rule for permission bits: the owner's bits if the user owns the file, else the
group's if the file's group is one of the user's groups, else the others' bits; one class
only, even when another would grant more. uid 0 is root, who reads and writes any file
(CAP_DAC_OVERRIDE): a root caller gains nothing through the server it could not do itself.
Access control lists are not consulted; an object that carries one is refused before this."""

from __future__ import annotations

import stat
from collections.abc import Collection
from enum import IntFlag


class Access(IntFlag):
    """The permission bits of one class (owner, group or others)."""

    READ = 4
    WRITE = 2


def refusal(
    uid: int, groups: Collection[int], st_uid: int, st_gid: int, st_mode: int, need: Access
) -> str | None:
    """Why `uid` (member of `groups`) may not open a file of owner `st_uid`, group `st_gid`
    and mode `st_mode` for `need`; None when it may."""
    if uid == 0:
        return None
    if uid == st_uid:
        granted, by = (st_mode >> 6) & 7, "its owner"
    elif st_gid in groups:
        granted, by = (st_mode >> 3) & 7, f"a member of its group {st_gid}"
    else:
        granted, by = st_mode & 7, "another user"
    missing = Access(need & ~granted & (Access.READ | Access.WRITE))
    if not missing:
        return None
    wanted = " and ".join(a.name.lower() for a in Access if a in missing)  # type: ignore[union-attr]
    return (
        f"uid {uid}, {by}, may not {wanted} it (owner uid {st_uid}, group {st_gid}, "
        f"mode {stat.S_IMODE(st_mode):04o})"
    )
