"""Logging set-up (JSON lines or readable text on stderr) and the sampled per-request log."""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import sys
import time
import zlib
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TextIO

import grpc

REQUEST_LOG = logging.getLogger("paddlequic.requests")
LOG_FORMATS = ("auto", "json", "text")

# ANSI SGR colours per level; text lines are coloured only on a terminal without NO_COLOR.
_LEVEL_COLOURS = {
    logging.DEBUG: "\x1b[2m",
    logging.INFO: "\x1b[32m",
    logging.WARNING: "\x1b[33m",
    logging.ERROR: "\x1b[31m",
    logging.CRITICAL: "\x1b[1;31m",
}
_DIM = "\x1b[2m"
_RESET = "\x1b[0m"
# Continuation lines of a multi-line message are indented under the message.
_CONTINUATION = "\n    "
# What one log line quotes, in UTF-8 bytes: each field (a caller's request id, model name, the
# error that answered it), the message, a traceback. A caller's text is the caller's size: 366
# failing calls with a 4 MiB id once grew the log by 116 MiB within the line budget.
FIELD_BYTES = 1024
# A Python model's printed line (up to 4096 characters, model_output.py) with its prefix.
MESSAGE_BYTES = 20 << 10
EXCEPTION_BYTES = 16 << 10
# A failing request's line costs one line of its budget per this many bytes of fields.
LINE_BYTES = 1024


def quoted(text: str, limit: int) -> str:
    """`text` as a log line quotes it: whole if it has at most `limit` UTF-8 bytes, else its
    first ones and its length."""
    if len(text) * 4 <= limit:  # at most 4 bytes a character: no need to encode
        return text
    head = text[:limit].encode()
    if len(text) <= limit and len(head) <= limit:
        return text
    return head[:limit].decode(errors="ignore") + f"... ({len(text)} characters)"


def quoted_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The fields with each text bounded (numbers and the like are bounded already)."""
    return {k: quoted(v, FIELD_BYTES) if isinstance(v, str) else v for k, v in fields.items()}


def fields_bytes(fields: Mapping[str, Any]) -> int:
    return sum(len(str(v).encode()) for v in fields.values())


class JsonFormatter(logging.Formatter):
    """One JSON object per line, so log pipelines need no parsing rules; a record's
    `fields` extra (a dict) is merged in."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "timestamp": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": quoted(record.getMessage(), MESSAGE_BYTES),
        }
        line.update(quoted_fields(getattr(record, "fields", {})))
        if record.exc_info:
            line["exception"] = quoted(self.formatException(record.exc_info), EXCEPTION_BYTES)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """One line a person reads: local time, level, logger, message, then the record's
    `fields` as key=value. A multi-line message keeps its lines, indented, instead of being
    escaped into one string."""

    def __init__(self, colour: bool) -> None:
        super().__init__()
        self.colour = colour

    def format(self, record: logging.LogRecord) -> str:
        clock = datetime.datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        stamp = f"{clock}.{int(record.msecs):03d}"
        level = f"{record.levelname:<7}"
        if self.colour:
            stamp = f"{_DIM}{stamp}{_RESET}"
            level = f"{_LEVEL_COLOURS.get(record.levelno, '')}{level}{_RESET}"
        parts = [stamp, level, f"{record.name}:", quoted(record.getMessage(), MESSAGE_BYTES)]
        fields = quoted_fields(getattr(record, "fields", {}))
        extras = " ".join(f"{k}={v}" for k, v in fields.items() if k != "event" and v != "")
        if extras:
            parts.append(f"{_DIM}{extras}{_RESET}" if self.colour else extras)
        text = " ".join(parts)
        if record.exc_info:
            text += "\n" + quoted(self.formatException(record.exc_info), EXCEPTION_BYTES)
        return text.replace("\n", _CONTINUATION)


def wants_colour(stream: TextIO, environ: Mapping[str, str]) -> bool:
    """https://no-color.org: a non-empty NO_COLOR turns colours off."""
    return stream.isatty() and not environ.get("NO_COLOR")


def make_formatter(
    log_format: str, stream: TextIO, environ: Mapping[str, str]
) -> logging.Formatter:
    """`auto` is text on a terminal (a person reads it) and JSON otherwise (a pipeline
    does), so JSON consumers see what they always saw."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be auto, json or text, not {log_format!r}")
    if log_format == "auto":
        log_format = "text" if stream.isatty() else "json"
    if log_format == "json":
        return JsonFormatter()
    return TextFormatter(colour=wants_colour(stream, environ))


def configure_logging(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(make_formatter(log_format, sys.stderr, os.environ))
    logging.basicConfig(level=level.upper(), handlers=[handler])


class LineBudget:
    """A token bucket per key: `burst` lines at once, refilled at `per_second`. A flood of
    failing requests (garbage, unauthenticated) then costs a few log lines, not one each;
    the lines left out are counted and reported with the next line of their key. A line
    costs one token per LINE_BYTES it quotes (at least one), so the budget bounds bytes too."""

    def __init__(
        self, burst: int, per_second: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.per_second = per_second
        self._clock = clock
        self._buckets: dict[Hashable, tuple[float, float, int]] = {}  # tokens, at, left out

    def admit(self, key: Hashable, size: int = 0) -> int | None:
        """None: leave this line of `size` bytes out; otherwise log it, with how many were
        left out before."""
        now = self._clock()
        tokens, at, left_out = self._buckets.get(key, (float(self.burst), now, 0))
        tokens = min(float(self.burst), tokens + (now - at) * self.per_second)
        cost = min(float(self.burst), max(1.0, size / LINE_BYTES))
        if tokens < cost:
            self._buckets[key] = (tokens, now, left_out + 1)
            return None
        self._buckets[key] = (tokens - cost, now, 0)
        return left_out


class RequestLog:
    """Logs every failed and every slow request, and `sample_ratio` of the others: enough to
    see what happens without one line per request at thousands of requests per second.
    With a `seed`, a request that carries an id is sampled by a hash of seed and id, so which
    ones are logged is reproducible whatever else the server is doing (tests). Failures are
    logged within a `LineBudget` per transport, RPC and status (the keys are bounded: RPCs
    are registered methods)."""

    def __init__(
        self,
        slow_ms: float,
        sample_ratio: float,
        seed: int | None,
        failures: LineBudget,
    ) -> None:
        self.slow_ms = slow_ms
        self.sample_ratio = sample_ratio
        self.seed = seed
        self._random = random.Random(seed)
        self.failures = failures

    def wanted(self, code: grpc.StatusCode, latency_ms: float, request_id: str = "") -> bool:
        if code is not grpc.StatusCode.OK or latency_ms >= self.slow_ms:
            return True
        if self.sample_ratio <= 0:
            return False
        if self.seed is not None and request_id:
            return sampled_by_id(self.seed, request_id, self.sample_ratio)
        return self._random.random() < self.sample_ratio

    def emit(self, code: grpc.StatusCode, latency_ms: float, fields: dict[str, Any]) -> None:
        level = logging.WARNING if code is not grpc.StatusCode.OK else logging.INFO
        fields = quoted_fields(fields)
        if code is not grpc.StatusCode.OK:
            key = (fields["transport"], fields["rpc"], code)
            left_out = self.failures.admit(key, fields_bytes(fields))
            if left_out is None:
                return
            if left_out:
                fields = {**fields, "left_out": left_out}
        fields = {"event": "request", **fields, "status": code.name, "latency_ms": latency_ms}
        REQUEST_LOG.log(
            level,
            "%s %s %s %.3f ms",
            fields["transport"],
            fields["rpc"],
            code.name,
            latency_ms,
            extra={"fields": fields},
        )


def sampled_by_id(seed: int, request_id: str, ratio: float) -> bool:
    return zlib.crc32(f"{seed}:{request_id}".encode()) < ratio * 2**32
