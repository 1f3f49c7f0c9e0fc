"""What a front-end process reports to the parent (STATS, JSON): its HTTP/3 counters ("h3",
its totals), the requests it holds of the versions it queues for itself ("held":
queue_sharing.py), the ModelStatistics counts of the calls it served itself ("models", deltas
since its last report: local_counts.py) and its own metrics ("metrics", its totals:
summed.py). Each key may be absent; a report too large for one frame goes as several."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.frontends.local_counts import add_counts, parse_counts
from service.frontends.stats import FrontendStats, Report
from service.observability.summed import ReportedMetrics, families_from_json
from service.registry.versions import ModelRegistry

log = logging.getLogger("paddlequic.frontends")
_frontend_log = logging.getLogger("paddlequic.frontend")  # ReportFrames runs in a front-end


@dataclass
class Payloads:
    """A report's STATS payloads, each within the frame limit; `left_out`: what could not fit
    even alone (its bytes), for the front-end to log."""

    payloads: list[bytes]
    left_out: dict[str, int]


def report_payloads(
    totals: dict[str, Any],
    models: list[dict[str, Any]],
    metrics: list[Any] | None,
    limit: int,
) -> Payloads:
    """One payload when the report fits in `limit` bytes (the usual case); else `totals` (the
    small parts: "h3", "held") in the first, the metrics in one of their own and the models'
    deltas spread over as many as they take. Metrics, or a version's delta, larger than
    `limit` alone are left out. Never no payload (the last answers the parent's query)."""
    whole = _encode(totals, models, metrics)
    if len(whole) <= limit:
        return Payloads([whole], {})
    out = Payloads([], {})
    if metrics is not None:
        alone = _encode({}, [], metrics)
        if len(alone) <= limit:
            out.payloads.append(alone)
        else:
            out.left_out["metrics"] = len(alone)
    base = len(_encode(totals, [], None))
    chunk: list[dict[str, Any]] = []
    size = base
    for entry in models:
        entry_size = len(_encode({}, [entry], None)) - len(_encode({}, [], None)) + 1
        if base + entry_size > limit:
            out.left_out[f"models {entry['model']} version {entry['version']}"] = entry_size
            continue
        if chunk and size + entry_size > limit:
            out.payloads.append(_encode(totals, chunk, None))
            totals, base, chunk = {}, len(_encode({}, [], None)), []
            size = base
        chunk.append(entry)
        size += entry_size
    if chunk or totals or not out.payloads:  # one at least: it may answer a query
        out.payloads.append(_encode(totals, chunk, None))
    return out


class ReportFrames:
    """A front-end's reports as STATS frames within the frame limit; a part that never fits
    is logged the first time it is left out."""

    def __init__(self, frontend: int, limit: int, send: Callable[[int, bytes], None]) -> None:
        """`send(call_id, payload)`: one STATS frame to the parent."""
        self._frontend = frontend
        self._limit = limit
        self._send = send
        self._left_out: set[str] = set()

    def send(
        self,
        totals: dict[str, Any],
        models: list[dict[str, Any]],
        metrics: list[Any] | None,
        answering: int,
    ) -> None:
        """`answering`: the STATS_QUERY this report answers (0: none); its last frame
        carries it."""
        report = report_payloads(totals, models, metrics, self._limit)
        for part, size in report.left_out.items():
            if part not in self._left_out:
                self._left_out.add(part)
                _frontend_log.error(
                    "front-end %d: its report's %s (%d bytes) are past the dispatch frame "
                    "limit (%d bytes): left out of the server's counts",
                    self._frontend,
                    part,
                    size,
                    self._limit,
                )
        last = len(report.payloads) - 1
        for position, payload in enumerate(report.payloads):
            self._send(answering if position == last else 0, payload)


def _encode(totals: dict[str, Any], models: list[dict[str, Any]], metrics: Any) -> bytes:
    report = dict(totals)
    if models:
        report["models"] = models
    if metrics is not None:
        report["metrics"] = metrics
    return json.dumps(report, separators=(",", ":")).encode()


class Reports:
    """The parent's end: each front-end's report applied, once all of it is read as valid
    (a report with anything malformed is logged and dropped whole)."""

    def __init__(
        self, h3: FrontendStats, models: ModelRegistry, metrics: ReportedMetrics | None
    ) -> None:
        """`metrics`: None with --no-metrics (front-ends' metrics are dropped)."""
        self.h3 = h3
        self._models = models
        self._metrics = metrics

    def report(self, source: object, payload: bytes) -> dict[str, Any] | None:
        """The report as read, for what else it carries ("held"); None: dropped."""
        try:
            data = json.loads(payload)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            h3 = Report.from_json(data["h3"]) if "h3" in data else None
            counts = parse_counts(data["models"]) if "models" in data else []
            families = families_from_json(data["metrics"]) if "metrics" in data else None
        except (ValueError, KeyError, TypeError) as exc:
            log.error("a front-end's report was dropped: %s", exc)
            return None
        if h3 is not None:
            self.h3.report(source, h3)
        add_counts(self._models, counts)
        if families is not None and self._metrics is not None:
            self._metrics.report(source, families)
        return data

    def retire(self, source: object) -> None:
        """The front-end exited: its last totals stay in the sums, its gauges go."""
        self.h3.retire(source)
        if self._metrics is not None:
            self._metrics.retire(source)
