"""nginx's lingering close, for the REST listener's connections. A server that closes a
connection while its client is still sending (a body refused once it passed
--http-max-input-size) closes a socket with bytes unread, and the kernel answers with a reset:
the client's next write fails, often before it has read the answer it was sent, and a client
that writes all of its body before reading (http.client, urllib) never reads it. So the
connection's sending side is shut first (the client reads the answer, then the end of the
stream), and what the client still sends is read and dropped until it closes, for at most
LINGER_S seconds and LINGER_BYTES bytes per connection; then the connection is closed whatever
is left (with a reset at worst, as before).

hypercorn's `TCPServer` closes its connection through the writer it is given (`write_eof`,
`close`, `wait_closed`), so it is given a `LingeringWriter`: its `close` lingers where the
client has not ended its side, and the connection's task waits on `lingered` once hypercorn is
done with it (`end` if it is cancelled first)."""

from __future__ import annotations

import asyncio
from typing import Any

# Per connection, from the server's close: nginx's lingering_timeout, here for all of it.
LINGER_S = 5.0
# Per connection, dropped: --http-max-input-size's default (Triton's), as much as one request
# may send and be read; reading to drop holds no memory.
LINGER_BYTES = 64 << 20


class _Discard(asyncio.Protocol):
    """Drops what the client still sends, closing the connection once it is over LINGER_BYTES
    or LINGER_S has passed. The writing side's events go on to the protocol it replaced, which
    the connection's `StreamWriter` waits on."""

    def __init__(self, transport: asyncio.Transport, replaced: asyncio.BaseProtocol) -> None:
        self._transport = transport
        self._replaced = replaced
        self._left = LINGER_BYTES
        loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._deadline = loop.call_later(LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        self._left -= len(data)
        if self._left < 0:
            self._transport.abort()

    def eof_received(self) -> bool:
        return False  # the client is done: the transport closes

    def pause_writing(self) -> None:
        self._replaced.pause_writing()

    def resume_writing(self) -> None:
        self._replaced.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline.cancel()
        self._replaced.connection_lost(exc)
        if not self.closed.done():
            self.closed.set_result(None)


class LingeringWriter:
    """The `StreamWriter` that hypercorn's `TCPServer` writes to and closes: a close while the
    client has not ended its side shuts the sending side and lingers (`_Discard`), and the
    reader hypercorn reads from ends, so its read loop ends as at the client's end."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._discard: _Discard | None = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._writer.get_extra_info(name, default)

    def write(self, data: bytes) -> None:
        self._writer.write(data)

    async def drain(self) -> None:
        await self._writer.drain()

    def write_eof(self) -> None:
        self._writer.write_eof()

    def close(self) -> None:
        transport = self._writer.transport
        if self._discard is not None or transport.is_closing():
            return
        client_done = self._reader.at_eof() or self._reader.exception() is not None
        if client_done or not isinstance(transport, asyncio.Transport):
            self._writer.close()
            return
        if transport.can_write_eof():
            transport.write_eof()  # after what is buffered: the answer, then the end
        self._discard = _Discard(transport, transport.get_protocol())
        transport.set_protocol(self._discard)
        transport.resume_reading()  # the reader may have paused it, its buffer full
        self._reader.feed_eof()

    async def wait_closed(self) -> None:
        if self._discard is None:
            await self._writer.wait_closed()

    async def lingered(self) -> None:
        """Until a lingering connection is closed (at once if it did not linger)."""
        if self._discard is not None:
            await asyncio.shield(self._discard.closed)

    def end(self) -> None:
        """Closes a connection still lingering now (its task was cancelled: the listener
        stops)."""
        if self._discard is not None and not self._discard.closed.done():
            self._writer.transport.abort()
