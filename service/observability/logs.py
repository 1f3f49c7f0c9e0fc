"""Logging set-up (JSON lines or text on stderr) and the sampled per-request log."""

from __future__ import annotations

import datetime
import json
import logging
import random
import sys
import zlib
from typing import Any

import grpc

REQUEST_LOG = logging.getLogger("paddlequic.requests")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
            "message": record.getMessage(),
        }
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(log_format: str, level: str) -> None:
    if log_format not in ("json", "text"):
        raise ValueError(f"--log-format must be json or text, not {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=level.upper(), handlers=[handler])


class RequestLog:
    """Logs every failed and every slow request, and `sample_ratio` of the others: enough to
    see what happens without one line per request at thousands of requests per second.
    With a `seed`, a request that carries an id is sampled by a hash of seed and id, so which
    ones are logged is reproducible whatever else the server is doing (tests)."""

    def __init__(self, slow_ms: float, sample_ratio: float, seed: int | None) -> None:
        self.slow_ms = slow_ms
        self.sample_ratio = sample_ratio
        self.seed = seed
        self._random = random.Random(seed)

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
