"""gRPC length-prefixed message framing: 1 flag byte, 4-byte big-endian length, payload; and
the compressed messages a peer may send (gzip, deflate), inflated within the message limit."""

from __future__ import annotations

import struct
import zlib
from collections import deque

import grpc

from transport.grpc.errors import ProtocolError

HEADER_SIZE = 5
DEFAULT_MAX_MESSAGE = 64 * 1024 * 1024

_HEADER = struct.Struct(">BI")

IDENTITY = "identity"
# What grpcio accepts over HTTP/2, and says so in grpc-accept-encoding.
ACCEPTED_ENCODINGS = (IDENTITY, "deflate", "gzip")
ACCEPT_ENCODING = ",".join(ACCEPTED_ENCODINGS)
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}  # deflate is zlib's format
INFLATE_CHUNK = 64 << 10  # what inflating holds at once before the size is known


def encode_message(payload: bytes, compressed: bool = False) -> bytes:
    """Frame one message (`compressed`: the payload is in the call's grpc-encoding)."""
    if len(payload) > 0xFFFFFFFF:
        raise ValueError(f"message of {len(payload)} bytes does not fit a 4-byte length")
    return _HEADER.pack(int(compressed), len(payload)) + payload


def inflated_size(data: bytes, encoding: str, limit: int) -> int:
    """The size `data` inflates to, found without holding more than INFLATE_CHUNK of output:
    a small message that would inflate to gigabytes (a decompression bomb) is refused with
    RESOURCE_EXHAUSTED once its output passes `limit`; broken data is INTERNAL."""
    inflater = zlib.decompressobj(_WBITS[encoding])
    view = memoryview(data)
    size, output = 0, b""

    def inflate_some(piece: bytes | memoryview) -> bytes:
        nonlocal size
        output = inflater.decompress(piece, INFLATE_CHUNK)
        size += len(output)
        if size > limit:
            raise ProtocolError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{encoding} message inflates past the limit of {limit} bytes",
            )
        return output

    try:
        # Input goes in slices: what zlib leaves unconsumed is copied on every call.
        for start in range(0, len(view), INFLATE_CHUNK):
            output = inflate_some(view[start : start + INFLATE_CHUNK])
            while inflater.unconsumed_tail:
                output = inflate_some(inflater.unconsumed_tail)
        while len(output) == INFLATE_CHUNK:  # output zlib may still hold for input it took
            output = inflate_some(b"")
    except zlib.error as exc:
        message = f"invalid {encoding} message: {exc}"
        raise ProtocolError(grpc.StatusCode.INTERNAL, message) from None
    if not inflater.eof or inflater.unused_data:
        raise ProtocolError(
            grpc.StatusCode.INTERNAL, f"invalid {encoding} message: truncated or trailing data"
        )
    return size


def inflate(data: bytes, encoding: str, limit: int) -> bytes:
    """The message `data` holds in `encoding`; its size is checked first (inflated_size), so
    the whole inflated message is only ever built when it is within `limit`."""
    inflated_size(data, encoding, limit)
    return decompress(data, encoding)


def decompress(data: bytes, encoding: str) -> bytes:
    """`data` inflated whole: only for data whose inflated size was checked (inflated_size)."""
    return zlib.decompress(data, _WBITS[encoding])


class MessageDecoder:
    """Incremental decoder: DATA frame boundaries have no relation to message boundaries.

    Chunks are queued and joined once per message, so a large message arriving in small
    pieces costs linear, not quadratic, copying.
    """

    def __init__(self, max_message: int = DEFAULT_MAX_MESSAGE, encoding: str = IDENTITY) -> None:
        self._max_message = max_message
        self.encoding = encoding  # the stream's grpc-encoding, for messages flagged compressed
        self._compressed = False  # the current message's flag
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
        """Add received bytes; return the messages they complete (inflated)."""
        return [message for message, _ in self.feed_sized(data)]

    def feed_sized(self, data: bytes) -> list[tuple[bytes, int]]:
        """As `feed`, each message with its size on the wire (prefix included), which is what
        it held of the stream's window whatever it inflates to."""
        if data:
            self._chunks.append(data)
            self._queued += len(data)
        messages: list[tuple[bytes, int]] = []
        while True:
            if self._body_size is None:
                if self._queued < HEADER_SIZE:
                    return messages
                self._body_size = self._parse_header(self._take(HEADER_SIZE))
            if self._queued < self._body_size:
                return messages
            payload = self._take(self._body_size)
            if self._compressed:
                payload = inflate(payload, self.encoding, self._max_message)
            messages.append((payload, HEADER_SIZE + self._body_size))
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
        if flag == 1 and self.encoding not in _WBITS:
            raise ProtocolError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"compressed message with grpc-encoding {self.encoding!r} "
                f"(accepted: {ACCEPT_ENCODING})",
            )
        if flag > 1:
            raise ProtocolError(grpc.StatusCode.INTERNAL, f"invalid compressed flag {flag}")
        if size > self._max_message:
            raise ProtocolError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"message of {size} bytes exceeds the limit of {self._max_message} bytes",
            )
        self._compressed = flag == 1
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
