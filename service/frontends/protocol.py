"""The dispatch protocol between front-end processes and the parent, sans I/O.

Every frame is a 9-byte header (payload length, kind, call id; big-endian) and a payload. A
front-end passes each call's messages as the bytes it received, never parsed: the parent
deserializes them for the servicer, so protobuf runs once per message, in one process. Both
directions grant credit per call (CREDIT frames), so a peer that stops reading holds at most
`WINDOW` messages of a call in the other process."""

from __future__ import annotations

import enum
import json
import struct
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

from service.inference.identity import ANYONE, Identity, identity_of

WINDOW = 8  # messages of one call, per direction, sent before the receiver gives credit
HEADER = struct.Struct(">IBI")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_OPEN = struct.Struct(">dH")  # deadline, CLOCK_MONOTONIC (negative: none), metadata entries
_STATUS = struct.Struct(">HI")  # code, details length
_NO_TIMEOUT = -1.0

Metadata = tuple[tuple[str, str | bytes], ...]
AuthContext = tuple[tuple[str, tuple[bytes, ...]], ...]


class Kind(enum.IntEnum):
    HELLO = 1  # front-end -> parent, call 0: its index (u16)
    OPEN = 2  # front-end -> parent: a call starts (Open)
    MESSAGE = 3  # both ways: one message, its bytes as received
    HALF_CLOSE = 4  # front-end -> parent: the client sends no more messages
    CANCEL = 5  # front-end -> parent: the client is gone
    CREDIT = 6  # both ways: the receiver consumed this many messages (u32)
    HEADERS = 7  # parent -> front-end: initial metadata
    STATUS = 8  # parent -> front-end: the call's end (Status)
    # front-end -> parent: its counters (JSON, reports.py); the call id: the last STATS_QUERY
    # this report answers (its last frame, when it takes several), 0 for none
    STATS = 9
    STATS_QUERY = 10  # parent -> front-end: send STATS now; the call id numbers the query
    MODELS = 11  # parent -> front-end, call 0: the served versions it may describe (descriptors)
    INFER = 12  # front-end -> parent: a ModelInfer call, decoded and validated (descriptors)
    STALE = 13  # parent -> front-end: that INFER's view is outdated; pass the call on as bytes
    REFUSED = 14  # front-end -> parent: a ModelInfer call it refused and answered (descriptors)
    # Front-ends writing into workers' queues themselves (queue_sharing.py, shared_versions.py):
    QUEUED = 15  # parent -> front-end, call 0: the versions it may queue for itself (JSON)
    WORKER = 16  # parent -> front-end, call 0: an instance's worker is ready, ended, or failed
    TROUBLE = 17  # front-end -> parent, call 0: a worker hung or broke its queues (JSON)
    RELEASED = 18  # front-end -> parent, call 0: it holds no more requests of a version (u32)
    # parent -> front-end, call 0, on HELLO: the method paths the parent registered (a JSON
    # list), which label the calls a front-end's transport answers itself
    METHODS = 19


class ProtocolViolation(ValueError):
    """Bytes that are not this protocol: the link is closed."""


class Frame(NamedTuple):
    kind: Kind
    call_id: int
    payload: bytes


@dataclass(frozen=True)
class Open:
    method: str
    transport: str  # h2 or h3: the label metrics, logs and traces carry
    peer: str
    timeout: float | None
    metadata: Metadata
    identity: Identity = ANYONE  # the client certificate's, as the front-end's TLS saw it
    # The transport's auth context (grpcio's `auth_context()`: property -> values), for the
    # calls passed on as streams; a ModelInfer's servicer never reads it.
    auth: AuthContext = ()


def opened_of(method: str, transport: str, context: Any, auth: AuthContext = ()) -> Open:
    """The Open of a call a front-end's transport got, from its servicer context."""
    return Open(
        method,
        transport,
        context.peer(),
        context.time_remaining(),
        tuple(context.invocation_metadata() or ()),
        identity_of(context),
        auth,
    )


# An Open's transport with this after it: the part of a ModelStreamInfer stream that the
# front-end holds and observes itself (stream_here.py), run by the parent unobserved.
PART = "+part"


@dataclass(frozen=True)
class Status:
    code: grpc.StatusCode
    details: str
    trailing: Metadata


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def frame(kind: Kind, call_id: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind, call_id) + payload


def encode_open(call: Open) -> bytes:
    """The call's deadline travels as a point in time (CLOCK_MONOTONIC, one clock for every
    process of the host), not as the time left: what the frame spent on its way, and waiting
    to be read, is then not given to the call again at the other end."""
    timeout = _NO_TIMEOUT if call.timeout is None else time.monotonic() + max(call.timeout, 0.0)
    return b"".join(
        (
            encode_text(call.method),
            encode_text(call.transport),
            encode_text(call.peer),
            _OPEN.pack(timeout, len(call.metadata)),
            encode_metadata_entries(call.metadata),
            _U16.pack(len(call.identity)),
            *_parts(call.identity),
            _U16.pack(len(call.auth)),
            *(
                encode_text(name) + _U16.pack(len(values)) + b"".join(_parts(values))
                for name, values in call.auth
            ),
        )
    )


def auth_of(context: Mapping[str, Sequence[bytes]] | None) -> AuthContext:
    """A servicer context's `auth_context()` as an Open carries it."""
    return tuple((name, tuple(values)) for name, values in (context or {}).items())


def _parts(values: Sequence[bytes]) -> Iterator[bytes]:
    for value in values:
        yield _U32.pack(len(value))
        yield value


def _read_parts(reader: Reader) -> tuple[bytes, ...]:
    """What a 2-byte count and `_parts` wrote."""
    (count,) = reader.unpack(_U16)
    return tuple(reader.take(reader.unpack(_U32)[0]) for _ in range(count))


def decode_open(payload: bytes) -> Open:
    reader = Reader(payload)
    method, transport, peer = reader.text(), reader.text(), reader.text()
    deadline, count = reader.unpack(_OPEN)
    metadata = reader.metadata(count)
    identity = _read_parts(reader)
    (properties,) = reader.unpack(_U16)
    auth = [(reader.text(), _read_parts(reader)) for _ in range(properties)]
    reader.end()
    timeout = None if deadline < 0 else max(deadline - time.monotonic(), 0.0)
    return Open(method, transport, peer, timeout, metadata, identity, tuple(auth))


def encode_metadata(metadata: Sequence[tuple[str, str | bytes]]) -> bytes:
    return _U16.pack(len(metadata)) + encode_metadata_entries(metadata)


def decode_metadata(payload: bytes) -> Metadata:
    reader = Reader(payload)
    (count,) = reader.unpack(_U16)
    metadata = reader.metadata(count)
    reader.end()
    return metadata


def encode_status(status: Status) -> bytes:
    details = status.details.encode()
    return (
        _STATUS.pack(status.code.value[0], len(details))
        + details
        + encode_metadata(status.trailing)
    )


def decode_status(payload: bytes) -> Status:
    reader = Reader(payload)
    value, size = reader.unpack(_STATUS)
    code = _CODES.get(value)
    if code is None:
        raise ProtocolViolation(f"unknown status code {value}")
    details = reader.take(size).decode(errors="replace")
    (count,) = reader.unpack(_U16)
    trailing = reader.metadata(count)
    reader.end()
    return Status(code, details, trailing)


def encode_count(count: int) -> bytes:
    return _U32.pack(count)


def decode_count(payload: bytes) -> int:
    if len(payload) != _U32.size:
        raise ProtocolViolation("a count is 4 bytes")
    return int(_U32.unpack(payload)[0])


def encode_metadata_entries(metadata: Sequence[tuple[str, str | bytes]]) -> bytes:
    """Each entry: key, a flag (1: the value is bytes, as `-bin` keys carry), the value."""
    parts: list[bytes] = []
    for key, value in metadata:
        raw = value if isinstance(value, bytes) else str(value).encode()
        parts += (encode_text(key), bytes((isinstance(value, bytes),)), _U32.pack(len(raw)), raw)
    return b"".join(parts)


class FrameDecoder:
    """Incremental: reads split frames anywhere; a frame over `max_payload` is a violation."""

    def __init__(self, max_payload: int) -> None:
        self._max_payload = max_payload
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames: list[Frame] = []
        offset = 0
        while len(self._buffer) - offset >= HEADER.size:
            size, kind, call_id = HEADER.unpack_from(self._buffer, offset)
            if size > self._max_payload:
                raise ProtocolViolation(f"frame of {size} bytes over {self._max_payload}")
            end = offset + HEADER.size + size
            if len(self._buffer) < end:
                break
            try:
                known = Kind(kind)
            except ValueError:
                raise ProtocolViolation(f"unknown frame kind {kind}") from None
            frames.append(Frame(known, call_id, bytes(self._buffer[offset + HEADER.size : end])))
            offset = end
        del self._buffer[:offset]
        return frames


MAX_TEXT_BYTES = 0xFFFF  # a text field's length is 2 bytes


def encode_text(value: str) -> bytes:
    raw = value.encode()
    if len(raw) > MAX_TEXT_BYTES:
        raise ValueError(f"text of {len(raw)} bytes does not fit a 2-byte length")
    return _U16.pack(len(raw)) + raw


class Reader:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self._size = len(data)
        self._offset = 0

    def take(self, size: int) -> bytes:
        end = self._offset + size
        if end > self._size:
            raise ProtocolViolation("payload ends early")
        chunk = self._data[self._offset : end]
        self._offset = end
        return chunk

    def unpack(self, layout: struct.Struct) -> tuple[Any, ...]:
        offset = self._offset
        self._offset = offset + layout.size
        if self._offset > self._size:
            raise ProtocolViolation("payload ends early")
        return layout.unpack_from(self._data, offset)

    def text(self) -> str:
        """A 2-byte length and UTF-8 (read in one step: descriptors carry a dozen per call)."""
        data, start = self._data, self._offset + _U16.size
        if start > self._size:
            raise ProtocolViolation("payload ends early")
        end = start + _U16.unpack_from(data, self._offset)[0]
        if end > self._size:
            raise ProtocolViolation("payload ends early")
        self._offset = end
        return data[start:end].decode(errors="replace")

    def metadata(self, count: int) -> Metadata:
        entries: list[tuple[str, str | bytes]] = []
        for _ in range(count):
            key = self.text()
            is_bytes = self.take(1) == b"\x01"
            (size,) = self.unpack(_U32)
            raw = self.take(size)
            entries.append((key, raw if is_bytes else raw.decode(errors="replace")))
        return tuple(entries)

    def rest(self) -> bytes:
        """Everything not read yet (a last field that runs to the payload's end)."""
        return self.take(self._size - self._offset)

    def end(self) -> None:
        if self._offset != self._size:
            raise ProtocolViolation(f"{self._size - self._offset} bytes after the payload")


def encode_methods(methods: Iterable[str]) -> bytes:
    """METHODS: the method paths the parent registered, for a front-end's labels."""
    return json.dumps(sorted(methods)).encode()


def decode_methods(payload: bytes) -> frozenset[str]:
    try:
        methods = json.loads(payload)
    except ValueError:
        methods = None
    if not isinstance(methods, list) or not all(isinstance(m, str) for m in methods):
        raise ProtocolViolation("METHODS is not a JSON list of method paths")
    return frozenset(methods)
