"""A body of newline-delimited JSON split into its lines as its chunks arrive, each line within
a size bound: an overlong line is skipped to its end without being held (only its number is
kept), so one bad line costs no more memory than a good one and fails only itself."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    number: int  # from 1, blank lines not counted
    data: bytes | None  # None: longer than the bound (its bytes were dropped)


class LineSplitter:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = bytearray()  # the line in progress, at most max_bytes
        self.overlong = False  # the line in progress passed the bound: dropped to its end
        self.count = 0

    def feed(self, chunk: bytes) -> list[Line]:
        """The lines `chunk` completes."""
        lines: list[Line] = []
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if not self.overlong:
                self.held += piece
                if len(self.held) > self.max_bytes:
                    self.overlong = True
                    self.held.clear()
            if end < 0:
                return lines
            line = self._line()
            if line is not None:
                lines.append(line)
            start = end + 1

    def end(self) -> list[Line]:
        """The last line, if the body did not end with a newline."""
        line = self._line()
        return [] if line is None else [line]

    def _line(self) -> Line | None:
        overlong, data = self.overlong, bytes(self.held)
        self.overlong = False
        self.held.clear()
        if not overlong and not data.strip():
            return None
        self.count += 1
        return Line(self.count, None if overlong else data)
