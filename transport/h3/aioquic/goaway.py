"""GOAWAY frames read from an HTTP/3 control stream, which aioquic's H3Connection skips (read a
second time by `h3_connection.GrpcH3Connection`)."""

from __future__ import annotations

import contextlib

from aioquic.buffer import Buffer, BufferReadError  # type: ignore[attr-defined]
from aioquic.h3.connection import FrameType


class GoawayReader:
    """The GOAWAY frames of a control stream (stream type, then frames). Other frames'
    payloads are skipped as they arrive, never buffered."""

    _MAX_GOAWAY_PAYLOAD = 8  # one variable-length integer

    def __init__(self) -> None:
        self._buffer = b""
        self._typed = False  # the stream type was read
        self._skip = 0  # payload bytes of an uninteresting frame still to come

    def feed(self, data: bytes) -> list[int]:
        """The ids of the GOAWAY frames that `data` completes."""
        self._buffer += data
        found: list[int] = []
        while self._buffer:
            if self._skip:
                skipped = min(self._skip, len(self._buffer))
                self._buffer = self._buffer[skipped:]
                self._skip -= skipped
                continue
            buf = Buffer(data=self._buffer)
            try:
                if not self._typed:
                    buf.pull_uint_var()
                    self._typed = True
                    self._buffer = self._buffer[buf.tell() :]
                    continue
                frame_type = buf.pull_uint_var()
                size = buf.pull_uint_var()
            except BufferReadError:
                break  # a header split across packets: wait for the rest
            start = buf.tell()
            if frame_type != FrameType.GOAWAY or size > self._MAX_GOAWAY_PAYLOAD:
                self._buffer = self._buffer[start:]
                self._skip = size
                continue
            if len(self._buffer) < start + size:
                break
            payload = self._buffer[start : start + size]
            self._buffer = self._buffer[start + size :]
            with contextlib.suppress(BufferReadError):
                found.append(Buffer(data=payload).pull_uint_var())
        return found
