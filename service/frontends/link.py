"""One end of a dispatch connection (a unix socket between a front-end and the parent):
frames in, routed by the subclass; frames out, gathered over one event-loop turn and written
in one go (one syscall, one wakeup of the other end, for the frames of many calls), drained by
senders."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Protocol

from service.frontends.protocol import (
    WINDOW,
    Frame,
    FrameDecoder,
    Kind,
    ProtocolViolation,
    encode_count,
    frame,
)
from service.inference.credit import ReturnedCredit

log = logging.getLogger("paddlequic.frontends")

READ_SIZE = 256 << 10
# Headroom over the largest message for a frame's other fields (metadata is bounded too).
FRAME_OVERHEAD = 1 << 20
# Frames gathered past this many bytes are written when a sender drains, not at the turn's end.
FLUSH_BYTES = 64 << 10


class FrameConnection:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_message: int
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.max_payload = max_message + FRAME_OVERHEAD  # the largest frame either end takes
        self._decoder = FrameDecoder(self.max_payload)
        self.closed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._outgoing: list[bytes] = []  # frames sent this loop turn, written when it ends
        self._outgoing_bytes = 0

    def send(self, kind: Kind, call_id: int, payload: bytes = b"") -> None:
        if self.closed.is_set():
            return
        if not self._outgoing:
            self._loop.call_soon(self.flush)
        data = frame(kind, call_id, payload)
        self._outgoing.append(data)
        self._outgoing_bytes += len(data)

    def flush(self) -> None:
        """Write the frames sent so far now."""
        outgoing, self._outgoing, self._outgoing_bytes = self._outgoing, [], 0
        if outgoing and not self.closed.is_set():
            self._writer.writelines(outgoing)

    def give_credit(self, call_id: int, count: int = 1) -> None:
        self.send(Kind.CREDIT, call_id, encode_count(count))

    def flush_large(self) -> None:
        """Write the frames gathered so far now if they are past FLUSH_BYTES, so what waits
        for the turn's end is bounded."""
        if self._outgoing_bytes >= FLUSH_BYTES:
            self.flush()

    async def drain(self) -> None:
        """Wait while the socket's buffer is full (the other process is behind), frames
        gathered past FLUSH_BYTES written first."""
        self.flush_large()
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()

    async def run(self) -> None:
        """Read until the other end closes or breaks the protocol; then `lost()`."""
        try:
            while data := await self._reader.read(READ_SIZE):
                for received in self._decoder.feed(data):
                    self.received(received)
        except (ConnectionError, ProtocolViolation) as exc:
            log.error("dispatch connection closed: %s", exc)
        except Exception:
            log.exception("dispatch connection closed on a bad frame")
        finally:
            self.closed.set()
            self._writer.close()
            self.lost()

    def received(self, received: Frame) -> None:
        raise NotImplementedError

    def lost(self) -> None:
        raise NotImplementedError


class Window:
    """Messages this end may still send on one call before the receiver gives credit."""

    def __init__(self, size: int = WINDOW) -> None:
        self._available = size
        self._opened = asyncio.Event()

    async def take(self) -> None:
        while self._available <= 0:
            self._opened.clear()
            await self._opened.wait()
        self._available -= 1

    def give(self, count: int) -> None:
        self._available += count
        self._opened.set()


class Creditor(Protocol):
    """Where an Inbox gives credit back: its connection."""

    def give_credit(self, call_id: int, count: int = 1) -> None: ...


class Inbox:
    """Messages of one call from the other end, then None (the sender is done). Messages taken
    give their credit back half a window at a time; a sender past its window breaks the
    protocol."""

    def __init__(self, connection: Creditor, call_id: int) -> None:
        self._connection = connection
        self._call_id = call_id
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._credit = ReturnedCredit(WINDOW)

    def put(self, message: bytes | None) -> None:
        if message is not None and not self._credit.allows(self._queue.qsize()):
            raise ProtocolViolation(f"call {self._call_id}: messages past the credit window")
        self._queue.put_nowait(message)

    async def get(self) -> bytes | None:
        message = await self._queue.get()
        if message is None:
            self._queue.put_nowait(None)  # every later read sees the end too
        elif credit := self._credit.took():
            self._connection.give_credit(self._call_id, credit)
        return message


QUESTIONS = 0xFFFFFFFF  # questions on a link are numbered 1 to this (a frame's call id), round


class Questions:
    """Questions one end asks the other on its link (a report wanted, regions to hold),
    numbered by the frames' call ids and answered in order: an answer numbered N answers every
    question up to N."""

    def __init__(self) -> None:
        self._number = 0
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []

    def ask(self) -> tuple[int, asyncio.Future[None]]:
        """The next question's number, and what is done once it is answered."""
        self._number = self._number % QUESTIONS + 1
        answered = asyncio.get_running_loop().create_future()
        self._waiting.append((self._number, answered))
        return self._number, answered

    def answered(self, number: int) -> None:
        waiting = []
        for asked, answered in self._waiting:
            if asked <= number:
                if not answered.done():
                    answered.set_result(None)
            else:
                waiting.append((asked, answered))
        self._waiting = waiting

    def none_coming(self) -> None:
        """The link is gone: nobody waits for an answer."""
        self.answered(QUESTIONS)


def received_with_fds(
    conn: socket.socket, max_bytes: int, max_fds: int
) -> tuple[bytes, list[int]] | None:
    """One message of a SOCK_SEQPACKET connection and the descriptors attached to it (b"":
    the other end closed it, or it broke); None: none is waiting."""
    try:
        data, fds, _, _ = socket.recv_fds(conn, max_bytes, max_fds)
    except BlockingIOError:
        return None
    except OSError:
        return b"", []
    return data, fds
