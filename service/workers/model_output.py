"""A Python model's prints (its worker's stdout and stderr, one pipe) into the server's log.

model.py is untrusted and may print without end: a thread per worker reads the pipe, so the
event loop never splits or logs a line of it, and the lines logged stay within a budget per
model version of lines and bytes per second (`OutputBudget`: pure, with an injected clock, as
CircuitBreaker is). Lines beyond it are counted (a metric) and dropped; the next line logged
is preceded by one saying how many were dropped, and so is the end of the output. Lines of
`pb_utils.Logger` are logged at their level (service/backend/model_log.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable

from service.backend.model_log import level_of

model_log = logging.getLogger("paddlequic.model")

MAX_LOG_LINE = 4096  # characters of one line a Python model prints, in the server's log
# What a line may hold in bytes before it is cut (UTF-8 takes at most 4 per character).
_MAX_LINE_BYTES = 4 * MAX_LOG_LINE
BURST_S = 10.0  # the budget holds this many seconds' worth: a model's start-up output fits
# Per model version (--model-output-lines, --model-output-bytes).
LINES_PER_S = 100.0
BYTES_PER_S = float(64 << 10)
_CHUNK = 1 << 16


class OutputBudget:
    """Two token buckets, lines and bytes (each line costs its bytes and its newline), each
    holding BURST_S seconds' worth of its rate and refilled continuously."""

    def __init__(
        self,
        lines_per_s: float = LINES_PER_S,
        bytes_per_s: float = BYTES_PER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lines_per_s = lines_per_s
        self.bytes_per_s = bytes_per_s
        self._clock = clock
        self._lines = lines_per_s * BURST_S
        self._bytes = bytes_per_s * BURST_S
        self._at = clock()
        self.dropped = 0  # every line dropped so far (the metric)
        self._unreported = 0  # dropped since the last report

    def admit(self, nbytes: int) -> int | None:
        """None: drop this line (counted); otherwise log it, after saying how many lines were
        dropped since the last report (the count returned; 0: say nothing)."""
        now = self._clock()
        elapsed = max(now - self._at, 0.0)
        self._at = now
        self._lines = min(self._lines + elapsed * self.lines_per_s, self.lines_per_s * BURST_S)
        self._bytes = min(self._bytes + elapsed * self.bytes_per_s, self.bytes_per_s * BURST_S)
        cost = nbytes + 1
        if self._lines < 1 or self._bytes < cost:
            self.dropped += 1
            self._unreported += 1
            return None
        self._lines -= 1
        self._bytes -= cost
        return self.take_unreported()

    def take_unreported(self) -> int:
        """Lines dropped since the last report (the output ended: say so now)."""
        unreported, self._unreported = self._unreported, 0
        return unreported


class ModelOutput:
    """One model version's output into the log, shared by its workers' reader threads."""

    def __init__(self, model: str, budget: OutputBudget) -> None:
        self.model = model
        self.budget = budget
        self._lock = threading.Lock()

    @property
    def dropped(self) -> int:
        return self.budget.dropped

    def line(self, raw: bytes) -> None:
        """One line as printed, cut at _MAX_LINE_BYTES: decoded only if it is logged, so a
        flood costs the reader little."""
        raw = raw[:_MAX_LINE_BYTES]
        with self._lock:
            dropped = self.budget.admit(len(raw))
        if dropped is None:
            return
        self._report(dropped)
        level, text = level_of(raw)
        model_log.log(
            level, "model %s: %s", self.model, text.decode(errors="replace")[:MAX_LOG_LINE]
        )

    def ended(self) -> None:
        with self._lock:
            dropped = self.budget.take_unreported()
        self._report(dropped)

    def _report(self, dropped: int) -> None:
        if dropped:
            model_log.warning(
                "model %s: %d line(s) of its output dropped, over its budget of %g lines and "
                "%g bytes per second (--model-output-lines, --model-output-bytes)",
                self.model,
                dropped,
                self.budget.lines_per_s,
                self.budget.bytes_per_s,
            )


class OutputReader:
    """A thread reading one worker's output pipe to its end, or until `stop()`; `done` is
    set on the event loop once it has finished."""

    def __init__(self, fd: int, output: ModelOutput) -> None:
        self._fd = fd
        self._output = output
        self._wake_r, self._wake_w = os.pipe()
        # Held while the descriptors are closed: stop() never writes to a number reused since.
        self._closing = threading.Lock()
        self._closed = False
        loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(
            target=self._run, args=(loop,), name=f"output {output.model}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop reading (something the worker started may hold its pipe open)."""
        with self._closing:
            if not self._closed:
                os.write(self._wake_w, b"x")

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self._read()
        finally:
            self._output.ended()
            with self._closing:
                self._closed = True
                for fd in (self._fd, self._wake_r, self._wake_w):
                    os.close(fd)
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(_set, self.done)

    def _read(self) -> None:
        pending = b""
        skipping = False  # the rest of a line already cut at _MAX_LINE_BYTES
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            if any(fd == self._wake_r for fd, _ in poller.poll()):
                return
            chunk = os.read(self._fd, _CHUNK)
            if not chunk:
                break
            *lines, rest = (pending + chunk).split(b"\n")
            for line in lines:
                if not skipping:
                    self._output.line(line)
                skipping = False
            if skipping:
                rest = b""
            elif len(rest) > _MAX_LINE_BYTES:
                self._output.line(rest)
                rest, skipping = b"", True
            pending = rest
        if pending:
            self._output.line(pending)


def _set(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
