"""How many connection IDs a connection issues, and what they start with (aioquic's
connection module and ID replenishment reached into)."""

from __future__ import annotations

import os
import types
from typing import Any

from aioquic.quic import connection as connection_module
from aioquic.quic.connection import QuicConnection

# Connection IDs each end holds for the other: RFC 9000's minimum. aioquic issues 7 spare IDs
# per connection (a NEW_CONNECTION_ID frame, 24 random bytes and a routing entry each) to
# peers that allow 8 as it does itself; a gRPC client rarely migrates, and a retired ID is
# replaced.
ACTIVE_CONNECTION_IDS = 2


def limit_connection_ids(quic: QuicConnection) -> None:
    """Ask the peer for `ACTIVE_CONNECTION_IDS` connection IDs and issue it no more than that
    (aioquic has no setting for either)."""
    quic._local_active_connection_id_limit = ACTIVE_CONNECTION_IDS
    replenish = quic._replenish_connection_ids

    def replenish_up_to_limit() -> None:
        quic._remote_active_connection_id_limit = min(
            quic._remote_active_connection_id_limit, ACTIVE_CONNECTION_IDS
        )
        replenish()

    quic._replenish_connection_ids = replenish_up_to_limit  # type: ignore[method-assign]


class _TaggingOs(types.ModuleType):
    """The `os` aioquic's connection module sees: `urandom(length)` for connection IDs of
    `length` bytes starts with `tag`; everything else is the real `os`."""

    def __init__(self, tag: int, length: int) -> None:
        super().__init__("os")
        self._tag = bytes((tag,))
        self._length = length

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def urandom(self, size: int) -> bytes:
        if size == self._length:
            return self._tag + os.urandom(size - 1)
        return os.urandom(size)


def tag_connection_ids(tag: int, length: int) -> None:
    """Every connection ID of `length` bytes this process's QUIC connections issue starts with
    the byte `tag` (aioquic draws them with `os.urandom(configuration.connection_id_length)`
    in `aioquic.quic.connection`, for the first ID and for NEW_CONNECTION_ID frames). Use a
    length no other random value of that module has (aioquic draws 8 and 16 bytes)."""
    connection_module.os = _TaggingOs(tag, length)  # type: ignore[attr-defined]
