"""A front-end's reports to the parent (their format and frames: reports.py): what goes in one,
and when the periodic one goes out."""

from __future__ import annotations

import math
from typing import Any, Protocol

from service.frontends.local_counts import LocalCounts
from service.frontends.reports import ReportFrames
from service.frontends.shared_versions import SharedVersions
from service.frontends.stats import report_of
from service.observability.metrics import Metrics
from service.observability.summed import families_json
from transport.h3.server import H3Server

# The longest a front-end's report waits while no call moves its counts: what drifts without
# calls (its process's CPU and memory) is at most this stale between scrapes' fresh reports.
IDLE_REPORT_EVERY_S = 30.0


class Sources(Protocol):
    """What a report is made of (the front-end's ParentLink holds them)."""

    h3: list[H3Server]  # the gRPC port's, and the REST port's
    shared: SharedVersions | None  # the versions it queues for itself
    counts: LocalCounts  # ModelStatistics of the calls it serves itself
    metrics: Metrics | None  # None: --no-metrics


class ReportPacing:
    """Whether a front-end's periodic report goes out: when what it carries moved since the
    last one, else only once each `idle_every_s`. An idle server's front-ends otherwise woke
    the parent every second with the same counts; what drifts with no call at all (process
    CPU and memory) waits at most `idle_every_s`, and the parent asks for a fresh report
    before each scrape and ModelStatistics answer anyway."""

    def __init__(self, idle_every_s: float) -> None:
        self._idle_every_s = idle_every_s
        self._last: object = None
        self._sent_at = -math.inf

    def due(self, now: float, moved: object) -> bool:
        """`moved`: what changes whenever the report may have (compared by ==); a report
        that goes out is taken as sent at `now`."""
        if moved == self._last and now - self._sent_at < self._idle_every_s:
            return False
        self._last, self._sent_at = moved, now
        return True


class ReportSender:
    def __init__(self, sources: Sources, frames: ReportFrames) -> None:
        self._sources = sources
        self._frames = frames
        self._pacing = ReportPacing(IDLE_REPORT_EVERY_S)

    def report(self, answering: int = 0) -> None:
        """This process's counts, to the parent (reports.py): its HTTP/3 servers', the
        requests it holds of the versions it queues for itself, the ModelStatistics counts and
        metrics of the calls it serves itself. `answering`: the STATS_QUERY this answers (0:
        none; its last frame carries it)."""
        self._send(self._totals(), self._sources.counts.take(), answering)

    def report_if_moved(self, now: float) -> object:
        """The periodic report (each REPORT_EVERY_S), left out while nothing in it moved:
        no call started or ended here, the totals are as last sent (ReportPacing). Returns
        what it compared."""
        totals = self._totals()
        models = self._sources.counts.take()
        metrics = self._sources.metrics
        moved = (totals, metrics.calls_seen() if metrics else None)
        if self._pacing.due(now, moved) or models:
            self._send(totals, models, 0)
        return moved

    def _totals(self) -> dict[str, Any]:
        totals: dict[str, Any] = {}
        sources = self._sources
        if sources.h3:
            totals["h3"] = report_of(sources.h3).to_json()
        if sources.shared is not None:
            totals["held"] = sources.shared.held()
            totals["breakers"] = sources.shared.breakers()
        return totals

    def _send(self, totals: dict[str, Any], models: list[Any], answering: int) -> None:
        metrics = self._sources.metrics
        if not (answering or totals or models or metrics):
            return
        families = families_json(metrics.registry.collect()) if metrics else None
        self._frames.send(totals, models, families, answering)
