"""What /metrics and TransportStats show of HTTP/3: one process's servers summed (the gRPC
port's and the REST port's); with several front-ends, their counters summed too (each
front-end reports its own over the dispatch connection), the calls each passed on and how
often one was restarted."""

from __future__ import annotations

import dataclasses
from collections import Counter as Tally
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from service.observability.children import Children
from transport.h3.server import H3Server
from transport.h3.server_state import H3ServerStats
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


class _Totals:
    """An H3State read from one summed report."""

    def _total(self) -> Report:
        raise NotImplementedError

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


def report_of(servers: Sequence[H3Server]) -> Report:
    """The counters of one process's HTTP/3 servers (the gRPC port's, the REST port's) as one
    report; their session tickets are one store's, counted once."""
    reports = [
        Report(
            server.stats,
            TicketCounters(),
            server.peak_send_buffered(),
            server.blocked_writers(),
            server.router.forwarded if server.router is not None else 0,
        )
        for server in servers
    ]
    store = servers[0].tickets
    total = _sum(reports, keep_gauges=True)
    return dataclasses.replace(total, tickets=store.counters if store else TicketCounters())


class ProcessH3(_Totals):
    """This process's HTTP/3 servers as one H3State."""

    def __init__(self, servers: Sequence[H3Server]) -> None:
        self._servers = servers

    def _total(self) -> Report:
        return report_of(self._servers)


class FrontendStats(_Totals):
    """The sum of the front-ends' latest reports (an H3State). A front-end that exits leaves
    its last counts in, so the sums never go down when one is restarted."""

    def __init__(self) -> None:
        self._live: dict[object, Report] = {}
        self._retired = _EMPTY

    def report(self, source: object, report: Report) -> None:
        self._live = {**self._live, source: report}

    def retire(self, source: object) -> None:
        live = dict(self._live)
        last = live.pop(source, None)
        if last is not None:
            self._retired = _sum([self._retired, last], keep_gauges=False)
        self._live = live

    def _total(self) -> Report:
        return _sum([self._retired, *self._live.values()], keep_gauges=True)


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
