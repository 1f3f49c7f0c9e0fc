"""A single-producer, single-consumer ring of variable-length records in shared memory: how a
request reaches a worker and its answer comes back without a process in the middle.

No lock: the producer writes a record, then advances `head` with one aligned 8-byte store; the
consumer reads `head`, then the record, then advances `tail` the same way. x86-64 keeps stores
in order and an aligned 8-byte `memoryview` store is one instruction, so the other side never
sees a position ahead of its record. Each side keeps its own position privately and only
publishes it: what it reads of the other side's (which may run model code) is checked before
use, and a record is copied out before it is parsed, so the writer cannot change it after the
check. A bad value raises Corrupt; the reader then stops trusting that writer.

Layout: a control block of two cache lines (head, then tail) and the data area. A record is a
4-byte length, 4 bytes of padding, the payload, padded to 8 bytes; one that would cross the
end of the data area goes to its start instead, after a WRAP length where it would have been.
"""

from __future__ import annotations

import struct

CONTROL_BYTES = 128
_HEAD = 0
_TAIL = 64
_LENGTH = struct.Struct("<I")
_PREFIX = 8
WRAP = 0xFFFFFFFF


class Corrupt(Exception):
    """The other side wrote a position or a length no correct writer writes."""


def aligned8(size: int) -> int:
    return (size + 7) & ~7


def max_record(capacity: int) -> int:
    """The largest payload a ring of `capacity` data bytes takes: half of it, so a record
    always fits once the ring has drained, wherever the last one ended."""
    return capacity // 2 - _PREFIX


class _Side:
    def __init__(self, control: memoryview, data: memoryview) -> None:
        if len(control) < CONTROL_BYTES or len(data) % 8 or not len(data):
            raise ValueError("a ring needs a 128-byte control block and data in 8-byte units")
        self._words = control[:CONTROL_BYTES].cast("Q")
        self._data = data
        self.capacity = len(data)

    def release(self) -> None:
        """Let go of the segment, so that it can be unmapped."""
        self._words.release()
        self._data.release()


class RingWriter(_Side):
    """The producer's end."""

    def __init__(self, control: memoryview, data: memoryview) -> None:
        super().__init__(control, data)
        self._head = 0  # ours: never read back from shared memory
        self._reserved = 0
        self._words[_HEAD // 8] = 0

    def reserve(self, size: int) -> memoryview | None:
        """Room for a payload of `size` bytes to write in place, published by commit(); None
        while the ring is too full. ValueError past max_record."""
        if size > max_record(self.capacity):
            most = max_record(self.capacity)
            raise ValueError(f"a record of {size} bytes; this ring takes {most}")
        tail = self._words[_TAIL // 8]
        head = self._head
        if not head - self.capacity <= tail <= head:
            raise Corrupt(f"the reader's position {tail}, {head - tail} behind the writer's")
        need = _PREFIX + aligned8(size)
        offset = head % self.capacity
        skip = self.capacity - offset if offset + need > self.capacity else 0
        if head + skip + need - tail > self.capacity:
            return None
        data = self._data
        if skip:
            _LENGTH.pack_into(data, offset, WRAP)
            offset = 0
        _LENGTH.pack_into(data, offset, size)
        self._reserved = head + skip + need
        return data[offset + _PREFIX : offset + _PREFIX + size]

    def commit(self) -> None:
        """Publish the record reserve() returned."""
        self._head = self._reserved
        self._words[_HEAD // 8] = self._head

    @property
    def taken(self) -> int:
        """How far the reader says it has read (unchecked: a sign of progress only)."""
        return int(self._words[_TAIL // 8])


class RingReader(_Side):
    """The consumer's end."""

    def __init__(self, control: memoryview, data: memoryview) -> None:
        super().__init__(control, data)
        self._tail = 0  # ours: never read back from shared memory
        self._words[_TAIL // 8] = 0

    def take(self) -> bytes | None:
        """The next record's payload, copied (so the writer cannot change it after it is
        checked), and its room given back; None when the ring is empty."""
        head = self._words[_HEAD // 8]
        tail = self._tail
        if not tail <= head <= tail + self.capacity:
            raise Corrupt(f"the writer's position {head}, {head - tail} ahead of the reader's")
        if head == tail:
            return None
        offset = tail % self.capacity
        (size,) = _LENGTH.unpack_from(self._data, offset)
        if size == WRAP:
            tail += self.capacity - offset
            offset = 0
            if head - tail < _PREFIX:
                raise Corrupt("a wrap with no record after it")
            (size,) = _LENGTH.unpack_from(self._data, 0)
        need = _PREFIX + aligned8(size)
        if size > max_record(self.capacity) or tail + need > head:
            raise Corrupt(f"a record of {size} bytes where {head - tail} are written")
        if offset + need > self.capacity:  # a correct writer wraps it
            raise Corrupt(f"a record of {size} bytes across the end of the ring")
        payload = bytes(self._data[offset + _PREFIX : offset + _PREFIX + size])
        self._tail = tail + need
        self._words[_TAIL // 8] = self._tail
        return payload

    def take_all(self) -> list[memoryview]:
        """Every record written so far, in order, and all their room given back: the bytes
        between the two positions copied once (twice where they wrap), each payload a view of
        the copy, parsed as take() parses one. On Corrupt nothing is taken."""
        head = self._words[_HEAD // 8]
        tail = self._tail
        if not tail <= head <= tail + self.capacity:
            raise Corrupt(f"the writer's position {head}, {head - tail} ahead of the reader's")
        taken = []
        largest = max_record(self.capacity)  # per take, not per record: a loop of many
        while tail != head:
            offset = tail % self.capacity
            chunk = memoryview(bytes(self._data[offset : min(offset + head - tail, self.capacity)]))
            at = 0
            while at < len(chunk):
                if len(chunk) - at < _LENGTH.size:
                    raise Corrupt(f"a record where {head - tail} bytes are written")
                (size,) = _LENGTH.unpack_from(chunk, at)
                if size == WRAP:
                    tail += self.capacity - offset - at
                    if head - tail < _PREFIX:
                        raise Corrupt("a wrap with no record after it")
                    break
                need = _PREFIX + aligned8(size)
                if size > largest or tail + need > head:
                    raise Corrupt(f"a record of {size} bytes where {head - tail} are written")
                if at + need > len(chunk):  # a correct writer wraps it
                    raise Corrupt(f"a record of {size} bytes across the end of the ring")
                taken.append(chunk[at + _PREFIX : at + _PREFIX + size])
                at += need
                tail += need
        self._tail = tail
        self._words[_TAIL // 8] = tail
        return taken
