"""What /metrics and TransportStats show of several front-ends: their HTTP/3 counters summed
(each front-end reports its own over the dispatch connection), the calls each passed on and
how often one was restarted."""

from __future__ import annotations

import dataclasses
from collections import Counter as Tally
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from service.observability.children import Children
from transport.h3.server import H3ServerStats
from transport.tls.session_tickets import TicketCounters


@dataclasses.dataclass(frozen=True)
class Report:
    """One front-end's HTTP/3 counters, as it sends them (`Report.of(h3).to_json()`)."""

    stats: H3ServerStats
    tickets: TicketCounters
    peak_send_buffered: int = 0
    blocked_writers: int = 0
    # QUIC datagrams passed to the front-end owning their connection (the client's address
    # changed and the kernel chose another front-end for it)
    forwarded: int = 0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Report:
        return cls(
            H3ServerStats(**data["stats"]),
            TicketCounters(**data["tickets"]),
            int(data["peak_send_buffered"]),
            int(data["blocked_writers"]),
            int(data["forwarded"]),
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_EMPTY = Report(H3ServerStats(), TicketCounters())


class _Tickets:
    def __init__(self, counters: TicketCounters) -> None:
        self.counters = counters


class FrontendStats:
    """The sum of the front-ends' latest reports (an H3State). A front-end that exits leaves
    its last counts in, so the sums never go down when one is restarted."""

    def __init__(self) -> None:
        self._live: dict[object, Report] = {}
        self._retired = _EMPTY

    def report(self, source: object, data: dict[str, Any]) -> None:
        self._live = {**self._live, source: Report.from_json(data)}

    def retire(self, source: object) -> None:
        live = dict(self._live)
        last = live.pop(source, None)
        if last is not None:
            self._retired = _sum([self._retired, last], keep_gauges=False)
        self._live = live

    def _total(self) -> Report:
        return _sum([self._retired, *self._live.values()], keep_gauges=True)

    @property
    def stats(self) -> H3ServerStats:
        return self._total().stats

    @property
    def tickets(self) -> _Tickets:
        return _Tickets(self._total().tickets)

    def peak_send_buffered(self) -> int:
        return self._total().peak_send_buffered

    def blocked_writers(self) -> int:
        return self._total().blocked_writers

    def forwarded(self) -> int:
        return self._total().forwarded


def _sum(reports: list[Report], keep_gauges: bool) -> Report:
    """Counters add up; the peak is the largest; blocked writers (a gauge) count only for
    live front-ends."""
    handshakes: Tally[str] = Tally()
    refusals: Tally[str] = Tally()
    tickets: Tally[str] = Tally()
    for report in reports:
        handshakes.update(report.stats.handshakes)
        refusals.update(report.stats.refusals)
        tickets.update(dataclasses.asdict(report.tickets))
    stats = H3ServerStats(
        connections=sum(r.stats.connections for r in reports),
        calls=sum(r.stats.calls for r in reports),
        rejected_streams=sum(r.stats.rejected_streams for r in reports),
        peak_send_buffered=max(r.stats.peak_send_buffered for r in reports),
        handshakes=dict(handshakes),
        refusals=dict(refusals),
    )
    return Report(
        stats,
        TicketCounters(**tickets),
        max(r.peak_send_buffered for r in reports),
        sum(r.blocked_writers for r in reports) if keep_gauges else 0,
        sum(r.forwarded for r in reports),
    )


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry, stats: FrontendStats) -> None:
        self.calls = Counter(
            "paddlequic_frontend_calls",
            "calls each front-end process passed on, by the transport it got them on",
            ["frontend", "transport"],
            registry=registry,
        )
        self.described = Counter(
            "paddlequic_frontend_described_calls",
            "of those calls, ModelInfer calls the front-end decoded and validated itself and "
            "passed on as a descriptor (or refused itself)",
            ["frontend", "transport"],
            registry=registry,
        )
        self.restarts = Counter(
            "paddlequic_frontend_restarts",
            "front-end processes restarted after exiting",
            registry=registry,
        )
        self._child = Children()
        registry.register(_Forwarded(stats))

    def call(self, frontend: str, transport: str, described: bool) -> None:
        self._child(self.calls, frontend, transport).inc()
        if described:
            self._child(self.described, frontend, transport).inc()


class _Forwarded(Collector):
    """Read on scrape from the front-ends' latest reports."""

    def __init__(self, stats: FrontendStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "paddlequic_frontend_datagrams_forwarded",
            "QUIC datagrams a front-end passed to the one owning their connection",
            value=self._stats.forwarded(),
        )
