"""A dispatch connection's writes: frames sent in one event-loop turn leave together at its end,
in order; a sender that drains past FLUSH_BYTES writes them at once."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from service.frontends.link import FLUSH_BYTES, FrameConnection
from service.frontends.protocol import Frame, FrameDecoder, Kind, frame


class _Sender(FrameConnection):
    def received(self, received: Frame) -> None:
        raise AssertionError("nothing is sent to the sender")

    def lost(self) -> None:
        return None


@pytest.fixture
async def ends() -> AsyncIterator[tuple[_Sender, socket.socket]]:
    """A connection on one end of a socket pair; the other end, a plain non-blocking socket."""
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    yield _Sender(reader, writer, 1 << 20), theirs
    writer.close()
    theirs.close()


def _waiting(peer: socket.socket) -> bytes:
    """What the other end can read now, without waiting."""
    try:
        return peer.recv(1 << 20)
    except BlockingIOError:
        return b""


async def test_frames_of_one_turn_leave_together_at_its_end(
    ends: tuple[_Sender, socket.socket],
) -> None:
    sender, peer = ends
    sender.send(Kind.MESSAGE, 1, b"answer")
    sender.send(Kind.STATUS, 1, b"status")
    sender.send(Kind.CREDIT, 2, b"\0\0\0\1")
    await sender.drain()  # under FLUSH_BYTES: nothing written before the turn ends
    assert _waiting(peer) == b""
    await asyncio.sleep(0)
    data = _waiting(peer)
    assert data == (
        frame(Kind.MESSAGE, 1, b"answer")
        + frame(Kind.STATUS, 1, b"status")
        + frame(Kind.CREDIT, 2, b"\0\0\0\1")
    )
    assert [(f.kind, f.call_id) for f in FrameDecoder(1 << 20).feed(data)] == [
        (Kind.MESSAGE, 1),
        (Kind.STATUS, 1),
        (Kind.CREDIT, 2),
    ]


async def test_a_drain_past_the_flush_size_writes_at_once(
    ends: tuple[_Sender, socket.socket],
) -> None:
    sender, peer = ends
    payload = b"x" * FLUSH_BYTES
    sender.send(Kind.MESSAGE, 1, payload)
    await sender.drain()
    received = b""
    while chunk := _waiting(peer):
        received += chunk
    assert received == frame(Kind.MESSAGE, 1, payload)
