"""A dispatch connection's writes: frames sent in one event-loop turn leave together at its end,
in order; a sender that drains past FLUSH_BYTES writes them at once. A call's inbox: the
credit it gives back for the messages read."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.frontends.link import FLUSH_BYTES, FrameConnection, Inbox
from service.frontends.protocol import WINDOW, Frame, FrameDecoder, Kind, ProtocolViolation, frame


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


class _Credits:
    """The connection an Inbox gives credit back to: what it gave, on its way to the sender."""

    def __init__(self) -> None:
        self.given: list[int] = []

    def give_credit(self, call_id: int, count: int = 1) -> None:
        self.given.append(count)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(steps=st.lists(st.sampled_from(["send", "read", "credit arrives", "overrun"]), max_size=80))
async def test_an_inbox_credits_half_a_window_at_once_and_refuses_a_sender_past_its_window(
    steps: list[str],
) -> None:
    """A sender that sends while it has credit, a reader, credit that reaches the sender late:
    the sender is refused only when it sends past its credit, fewer credits go back than
    messages are read, and whenever the reader finds nothing, the sender has credit."""
    credits = _Credits()
    inbox = Inbox(credits, 7)
    available, arrived, queued, read = WINDOW, 0, 0, 0
    for step in steps:
        if step == "send" and available:
            inbox.put(b"m")
            available, queued = available - 1, queued + 1
        elif step == "overrun" and not available:
            with pytest.raises(ProtocolViolation):
                inbox.put(b"m")
        elif step == "read":
            if not queued:  # the reader would wait: the sender must have credit
                assert available + sum(credits.given[arrived:]) > 0
                continue
            assert await inbox.get() == b"m"
            queued, read = queued - 1, read + 1
        elif step == "credit arrives" and arrived < len(credits.given):
            available += credits.given[arrived]
            arrived += 1
    assert len(credits.given) <= read // (WINDOW // 2)
    assert sum(credits.given) <= read
    inbox.put(None)
    for _ in range(queued):
        await inbox.get()
    assert await inbox.get() is None
