"""gRPC length-prefixed message framing: 1 flag byte, 4-byte big-endian length, payload."""

from __future__ import annotations

import struct
from collections import deque

import grpc

from transport.errors import ProtocolError

HEADER_SIZE = 5
DEFAULT_MAX_MESSAGE = 64 * 1024 * 1024

_HEADER = struct.Struct(">BI")


def encode_message(payload: bytes) -> bytes:
    """Frame one uncompressed message."""
    if len(payload) > 0xFFFFFFFF:
        raise ValueError(f"message of {len(payload)} bytes does not fit a 4-byte length")
    return _HEADER.pack(0, len(payload)) + payload


class MessageDecoder:
    """Incremental decoder: DATA frame boundaries have no relation to message boundaries.

    Chunks are queued and joined once per message, so a large message arriving in small
    pieces costs linear, not quadratic, copying.
    """

    def __init__(self, max_message: int = DEFAULT_MAX_MESSAGE) -> None:
        self._max_message = max_message
        self._chunks: deque[bytes] = deque()
        self._offset = 0  # bytes of _chunks[0] already consumed
        self._queued = 0  # unconsumed bytes in _chunks
        self._body_size: int | None = None  # set once the current message's header is read

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as messages (a parsed header included)."""
        return self._queued + (HEADER_SIZE if self._body_size is not None else 0)

    @property
    def in_progress(self) -> int:
        """Size on the wire (prefix included) of the message being received; 0 between
        messages."""
        return 0 if self._body_size is None else HEADER_SIZE + self._body_size

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return the messages they complete."""
        if data:
            self._chunks.append(data)
            self._queued += len(data)
        messages: list[bytes] = []
        while True:
            if self._body_size is None:
                if self._queued < HEADER_SIZE:
                    return messages
                self._body_size = self._parse_header(self._take(HEADER_SIZE))
            if self._queued < self._body_size:
                return messages
            messages.append(self._take(self._body_size))
            self._body_size = None

    def finish(self) -> None:
        """The stream ended: anything still buffered is a truncated message."""
        if self.buffered:
            raise ProtocolError(
                grpc.StatusCode.INTERNAL,
                f"stream ended inside a message ({self.buffered} bytes left over)",
            )

    def _parse_header(self, header: bytes) -> int:
        flag, size = _HEADER.unpack(header)
        if flag == 1:
            raise ProtocolError(
                grpc.StatusCode.UNIMPLEMENTED,
                "compressed messages are not supported (only identity encoding is accepted)",
            )
        if flag != 0:
            raise ProtocolError(grpc.StatusCode.INTERNAL, f"invalid compressed flag {flag}")
        if size > self._max_message:
            raise ProtocolError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"message of {size} bytes exceeds the limit of {self._max_message} bytes",
            )
        return int(size)

    def _take(self, size: int) -> bytes:
        """Remove exactly `size` queued bytes (the caller checked they are there)."""
        self._queued -= size
        parts: list[bytes] = []
        while size:
            chunk = self._chunks[0]
            end = self._offset + size
            if end < len(chunk):
                parts.append(chunk[self._offset : end])
                self._offset = end
                break
            parts.append(chunk[self._offset :])
            size = end - len(chunk)
            self._chunks.popleft()
            self._offset = 0
        return b"".join(parts)
