"""Counts that the processes serving the same ports keep together (`--frontends N`), so a
limit holds for the host, not for each process: connections in all and per client address,
unfinished handshakes, requests at once, bytes held for receiving.

One shared segment holds a block per process. A process writes only its own block and reads
the others' (one writer per block, no lock shared between processes); what it holds itself it
counts in its own memory and copies into its block, so its own count is always exact and only
the others' may be a moment old. A limit is then checked against its own count plus what the
others' blocks say: two processes admitting at the same instant may each count the other
without its newest addition, so a limit may be passed by at most one per other process (per
what is counted: connections or requests; the receive budget looks again after it publishes,
transport/h3/receive_budget.py).

A block: a sequence word, the counters, then a table of per-address entries (open addressing
with linear probing; a key is a hash of the scope and the address, never 0). The writer makes
the sequence odd while it changes the table (entries move when one is removed) and even again
after; a reader retries while it sees it odd or changed, and after `READ_TRIES` takes what it
read (a writer stopped mid-change must not stop every other process's admissions): only the
entries that change moves may be missed then, never the others. An entry's values changed in
place move nothing and leave the sequence as it is: a writer preempted while it updates its
count (every reservation of bytes does) must not make the others read its table as empty:
they would admit past the host's limits for as long as it stays stopped."""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
from dataclasses import dataclass

READ_TRIES = 8
_SEQUENCE = 0
_COUNTERS = 1  # the counters follow the sequence word


@dataclass(frozen=True)
class TallyLayout:
    processes: int
    counters: int  # per process
    slots: int  # per-address entries per process: a power of two
    columns: int  # values per entry

    def __post_init__(self) -> None:
        if self.slots & (self.slots - 1) or self.slots < 2:
            raise ValueError(f"slots must be a power of two, not {self.slots}")

    @property
    def entry_words(self) -> int:
        return 1 + self.columns

    @property
    def block_words(self) -> int:
        return _COUNTERS + self.counters + self.slots * self.entry_words

    @property
    def size(self) -> int:
        return self.processes * self.block_words * 8


def slots_for(entries: int) -> int:
    """A table for at most `entries` live entries, filled to a quarter at most."""
    slots = 2
    while slots < 4 * entries:
        slots *= 2
    return slots


@functools.lru_cache(maxsize=1024)  # a stream's reservation and release each look one up
def address_key(scope: int, address: str) -> int:
    """The same in every process (Python's own hash is not); never 0 (an empty slot)."""
    digest = hashlib.blake2b(address.encode(), digest_size=8, person=scope.to_bytes(2, "little"))
    return int.from_bytes(digest.digest(), "little", signed=True) or 1


def create(layout: TallyLayout) -> int:
    """A new segment of zeros: its file descriptor, which every process maps (`HostTally`)."""
    fd = os.memfd_create("paddlequic-tally", os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, layout.size)  # reserved now: a full /dev/shm fails here
    except OSError:
        os.close(fd)
        raise
    return fd


class HostTally:
    """One process's end: its own block written, the others' read."""

    def __init__(self, fd: int, layout: TallyLayout, index: int) -> None:
        if not 0 <= index < layout.processes:
            raise ValueError(f"process {index} of {layout.processes}")
        self.layout = layout
        self._map = mmap.mmap(fd, layout.size)
        self._words = memoryview(self._map).cast("q")
        self._block = index * layout.block_words
        self._others = [p * layout.block_words for p in range(layout.processes) if p != index]
        self._table = _COUNTERS + layout.counters
        self._mask = layout.slots - 1
        self._live = 0  # entries in its own table: at most half of its slots
        # Its block is its own from now: whatever a process before it in this place left (its
        # parent clears it too, at that one's death) is not counted, nor in the way of `_live`.
        clear(self._words, layout, index)

    def close(self) -> None:
        self._words.release()
        self._map.close()

    def set(self, counter: int, value: int) -> None:
        """This process's count (one aligned word: read whole by the others)."""
        self._words[self._block + _COUNTERS + counter] = value

    def others(self, counter: int) -> int:
        """The others' counts together."""
        words = self._words
        return sum(words[block + _COUNTERS + counter] for block in self._others)

    def set_at(self, key: int, values: tuple[int, ...]) -> bool:
        """This process's values for `key` (all zero: the entry goes); False when its table
        is half full (more live entries than it was made for): runs stay short, and every
        probe ends at an empty slot."""
        words, base = self._words, self._block + self._table
        found, slot = self._find(base, key)
        width, present = self.layout.entry_words, any(values)
        if not found:
            if not present:
                return True
            if not self.room():
                return False
            self._live += 1
        elif not present:
            self._live -= 1
        start = base + slot * width
        # Changed in place, no entry moves: a reader finds it whatever the sequence, and
        # reads each of its words whole, the old value or the new.
        moves = not (found and present)
        if moves:
            words[self._block + _SEQUENCE] += 1  # odd: changing
        try:
            if present:
                words[start] = key
                for column, value in enumerate(values, start=1):
                    words[start + column] = value
            else:
                self._remove(base, slot)
        finally:
            if moves:
                words[self._block + _SEQUENCE] += 1
        return True

    def room(self) -> bool:
        """Whether `set_at` takes a new key."""
        return self._live < self.layout.slots // 2

    def others_at(self, key: int) -> list[int]:
        """The others' values for `key`, column by column, together."""
        total = [0] * self.layout.columns
        for block in self._others:
            for column, value in enumerate(self._read(block, key)):
                total[column] += value
        return total

    def _read(self, block: int, key: int) -> tuple[int, ...]:
        words, sequence = self._words, block + _SEQUENCE
        values: tuple[int, ...] = ()
        for _ in range(READ_TRIES):
            before = words[sequence]
            found, slot = self._find(block + self._table, key)
            if found:
                start = block + self._table + slot * self.layout.entry_words + 1
                values = tuple(words[start : start + self.layout.columns])
            else:
                values = ()
            if not before & 1 and words[sequence] == before:
                break
        return values

    def _find(self, base: int, key: int) -> tuple[bool, int]:
        """(True, its slot), or (False, the empty slot it would take). A block read while
        its writer changes it may have no empty slot for a moment: the probe ends anyway."""
        words, width, mask = self._words, self.layout.entry_words, self._mask
        slot = key & mask
        for _ in range(self.layout.slots):
            held = words[base + slot * width]
            if held == key:
                return True, slot
            if held == 0:
                return False, slot
            slot = (slot + 1) & mask
        return False, slot

    def _remove(self, base: int, slot: int) -> None:
        """Empty `slot`, moving back each later entry of its run that would no longer be found
        past the gap (linear probing's deletion without markers)."""
        words, width, mask = self._words, self.layout.entry_words, self._mask
        gap, probe = slot, (slot + 1) & mask
        while words[base + probe * width]:
            home = words[base + probe * width] & mask
            # The entry may fill the gap if its home is not in the cyclic range (gap, probe].
            if (probe - home) & mask >= (probe - gap) & mask:
                start, target = base + probe * width, base + gap * width
                words[target : target + width] = words[start : start + width]
                gap = probe
            probe = (probe + 1) & mask
        start = base + gap * width
        words[start : start + width] = memoryview(bytes(8 * width)).cast("q")


def clear(words: memoryview, layout: TallyLayout, index: int) -> None:
    """Zero a process's block: it is gone, and what it held with it."""
    start = index * layout.block_words
    words[start : start + layout.block_words] = memoryview(bytes(8 * layout.block_words)).cast("q")


def clear_block(fd: int, layout: TallyLayout, index: int) -> None:
    """`clear`, from a process that does not map the segment (the parent, once a front-end
    died and before its successor starts: the one writer of that block then)."""
    with mmap.mmap(fd, layout.size) as segment, memoryview(segment) as view:
        words = view.cast("q")
        clear(words, layout, index)
        words.release()


class ScopedTally:
    """What one listener (a port and its protocol) counts in a HostTally: `counters` of them
    from `first`, and its per-address entries keyed by `scope`."""

    def __init__(self, tally: HostTally, scope: int, first: int) -> None:
        self._tally = tally
        self._scope = scope
        self._first = first

    def set(self, counter: int, value: int) -> None:
        self._tally.set(self._first + counter, value)

    def others(self, counter: int) -> int:
        return self._tally.others(self._first + counter)

    def set_at(self, address: str, values: tuple[int, ...]) -> bool:
        return self._tally.set_at(address_key(self._scope, address), values)

    def others_at(self, address: str) -> list[int]:
        return self._tally.others_at(address_key(self._scope, address))

    def room(self) -> bool:
        """Whether this process's table takes another address."""
        return self._tally.room()
