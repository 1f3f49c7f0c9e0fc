"""What one HTTP/3 request stream received, without I/O (aioquic's sans-I/O style): header
blocks, decoded messages (a plain HTTP request's body: its DATA as it came), the bytes they
hold, and the status a malformed stream fails with.
`transport.h3.protocol.H3Stream` wraps it with the asyncio waiters and the connection."""

from __future__ import annotations

import collections

import grpc

from transport.grpc.errors import ProtocolError
from transport.grpc.framing import MessageDecoder
from transport.grpc.headers import carries_grpc, message_encoding

Headers = list[tuple[bytes, bytes]]


class StreamClosed(Exception):
    """The stream ended abnormally; `status` is what the call should report."""

    def __init__(self, status: grpc.StatusCode, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.refused = refused  # the peer refused the stream unprocessed: safe to retry


class StreamState:
    """Incoming headers, messages and end of one stream.

    `held` is every payload byte received and not yet taken by the application, a partial
    message included: receive credit follows it, so a peer cannot make the stream buffer more
    than its window. A decode error (oversized, inflating past the limit, in an encoding not
    accepted, truncated message) fails the
    stream with its status as soon as it is seen; what arrives after that is dropped.
    """

    def __init__(self, max_message: int) -> None:
        self.decoder = MessageDecoder(max_message)
        self.headers: Headers | None = None
        self.trailers: Headers | None = None
        # Each message with its size on the wire: what it holds of the window.
        self.messages: collections.deque[tuple[bytes, int]] = collections.deque()
        self.ended = False  # the peer finished sending
        self.error: StreamClosed | None = None
        self.malformed = False  # the error is the peer's bad input: it is answered with it
        self.plain = False  # not a gRPC request: DATA is the body's bytes, not messages
        self._queued = 0  # wire bytes of `messages`, their 5-byte prefixes included

    @property
    def held(self) -> int:
        return self._queued + self.decoder.buffered

    @property
    def in_progress(self) -> int:
        """Wire size of the message being received (0 between messages or once failed)."""
        return 0 if self.error is not None else self.decoder.in_progress

    def headers_received(self, headers: Headers, ended: bool) -> None:
        if self.headers is None:
            self.headers = headers
            self.decoder.encoding = message_encoding(headers)
            self.plain = not carries_grpc(headers)
        else:
            self.trailers = headers
        self._end(ended)

    def data_received(self, data: bytes, ended: bool) -> bool:
        """Take DATA payload; False when the stream failed and the peer should stop sending."""
        if self.error is not None:
            return False
        if self.plain:
            if data:
                self.messages.append((data, len(data)))
                self._queued += len(data)
            self._end(ended)
            return True
        try:
            for message, wire_size in self.decoder.feed_sized(data):
                self.messages.append((message, wire_size))
                self._queued += wire_size
        except ProtocolError as exc:
            self._malformed(exc)
            return False
        self._end(ended)
        return self.error is None

    def take_message(self) -> bytes | None:
        """The next queued message, if any."""
        if not self.messages:
            return None
        message, wire_size = self.messages.popleft()
        self._queued -= wire_size
        return message

    def fail(self, error: StreamClosed) -> bool:
        """Record the first error; True if this one was it."""
        if self.error is not None:
            return False
        self.error = error
        return True

    def _end(self, ended: bool) -> None:
        if ended and not self.ended:
            self.ended = True
            try:
                self.decoder.finish()
            except ProtocolError as exc:
                self._malformed(exc)

    def _malformed(self, exc: ProtocolError) -> None:
        if self.fail(StreamClosed(exc.status, exc.message)):
            self.malformed = True
