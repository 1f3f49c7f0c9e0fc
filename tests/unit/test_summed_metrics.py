"""/metrics with front-end processes: the parent's families with every front-end's reported
families added (summed.py), written by the metrics endpoint as before."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from service.observability.exposition import metrics_app, on_loop
from service.observability.summed import (
    ReportedMetrics,
    Summed,
    families_from_json,
    families_json,
    sum_families,
)


def _process(calls: int, seconds: float, inflight: int, only: str = "") -> CollectorRegistry:
    """One process's registry: a counter, a histogram, a gauge (and a family of its own)."""
    registry = CollectorRegistry()
    counter = Counter("calls", "calls", ["model"], registry=registry)
    histogram = Histogram("took", "seconds", ["model"], buckets=(1.0, 10.0), registry=registry)
    gauge = Gauge("inflight", "in flight", registry=registry)
    counter.labels("m").inc(calls)
    histogram.labels("m").observe(seconds)
    gauge.set(inflight)
    if only:
        Counter(only, "one side's", registry=registry).inc(2)
    return registry


def _reported(registry: CollectorRegistry) -> list[Metric]:
    """As the parent reads a front-end's report."""
    return families_from_json(json.loads(json.dumps(families_json(registry.collect()))))


def _values(collector: Summed) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples written by the text format, read back by prometheus_client's parser."""
    text = generate_latest(collector).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_counters_histograms_and_gauges_of_every_process_add_up() -> None:
    parent = _process(1, 0.5, 1, only="parent_only")
    reported = ReportedMetrics()
    reported.report("a", _reported(_process(2, 5.0, 2, only="frontend_only")))
    reported.report("b", _reported(_process(4, 50.0, 4)))
    values = _values(Summed(parent, reported))
    assert values[("calls_total", (("model", "m"),))] == 7
    assert values[("took_count", (("model", "m"),))] == 3
    assert values[("took_sum", (("model", "m"),))] == 55.5
    buckets = {le: values[("took_bucket", (("le", le), ("model", "m")))] for le in ("1.0", "10.0")}
    assert buckets == {"1.0": 1, "10.0": 2}
    assert values[("took_bucket", (("le", "+Inf"), ("model", "m")))] == 3
    assert values[("inflight", ())] == 7
    assert values[("parent_only_total", ())] == 2  # a family one side has
    assert values[("frontend_only_total", ())] == 2


def test_an_exited_process_keeps_its_counts_and_loses_its_gauges() -> None:
    parent = _process(1, 0.5, 1)
    reported = ReportedMetrics()
    reported.report("a", _reported(_process(2, 5.0, 2, only="frontend_only")))
    reported.retire("a")
    reported.report("restarted", _reported(_process(4, 50.0, 4)))
    values = _values(Summed(parent, reported))
    assert values[("calls_total", (("model", "m"),))] == 7
    assert values[("took_count", (("model", "m"),))] == 3
    assert values[("frontend_only_total", ())] == 2
    assert values[("inflight", ())] == 5  # the parent's and the live front-end's
    reported.retire("restarted")
    assert _values(Summed(parent, reported))[("inflight", ())] == 1


def test_created_is_the_earliest_not_a_sum() -> None:
    parent, frontend = _process(1, 0.5, 1), _process(2, 5.0, 2)
    reported = ReportedMetrics()
    reported.report("a", _reported(frontend))

    def created(families: Iterable[Metric]) -> list[float]:
        return [s.value for f in families for s in f.samples if s.name == "calls_created"]

    summed = sum_families(parent.collect(), reported.sources())
    assert created(summed) == [min(created(parent.collect()) + created(frontend.collect()))]


def test_a_family_of_another_kind_than_the_parents_is_left_out() -> None:
    parent = _process(1, 0.5, 1)
    other = CollectorRegistry()
    Gauge("calls", "not a counter here", ["model"], registry=other).labels("m").set(100)
    reported = ReportedMetrics()
    reported.report("a", _reported(other))
    assert _values(Summed(parent, reported))[("calls_total", (("model", "m"),))] == 1


def test_with_no_report_the_text_is_the_parents_as_before() -> None:
    parent = _process(1, 0.5, 1)
    reported = ReportedMetrics()
    app = metrics_app(Summed(parent, reported), lambda: [], lambda: iter(()))
    body = b"".join(app({}, lambda status, headers: None))
    assert body == generate_latest(parent)
    reported.report("a", [])  # a front-end with nothing to add
    assert generate_latest(Summed(parent, reported)) == generate_latest(parent)


def test_the_endpoint_asks_for_reports_before_each_scrape_and_names_summed_samples() -> None:
    parent = _process(1, 0.5, 1)
    reported = ReportedMetrics()
    app = metrics_app(
        Summed(parent, reported),
        lambda: [],
        lambda: iter(()),
        lambda: reported.report("a", _reported(_process(2, 5.0, 2))),
    )
    environ = {"QUERY_STRING": "name[]=calls_total"}
    body = b"".join(app(environ, lambda status, headers: None)).decode()
    assert body.splitlines()[-1] == 'calls_total{model="m"} 3.0'
    assert "took" not in body


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({}, "metrics: not a list"),
        ([["calls", "counter", "calls"]], r"metrics\[0\]: not"),
        ([[1, "counter", "calls", []]], r"metrics\[0\]: name"),
        ([["calls", "info", "calls", []]], r"metrics\[0\]: kind 'info'"),
        ([["calls", "counter", "calls", [["calls_total", {"a": 1}, 1]]]], "labels"),
        ([["calls", "counter", "calls", [["calls_total", {}, "1"]]]], "value"),
        ([["calls", "counter", "calls", [["calls_total", {}, True]]]], "value"),
    ],
)
def test_a_malformed_report_is_refused(data: object, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        families_from_json(data)


async def test_a_scrape_waits_for_the_front_ends_within_its_bound() -> None:
    """A refresh that never ends is given up after the bound (and cancelled); a loop that is
    gone is not waited for."""
    cancelled = asyncio.Event()

    async def never() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    await asyncio.to_thread(on_loop(asyncio.get_running_loop(), never, 0.05))
    await asyncio.wait_for(cancelled.wait(), 10)
    gone = asyncio.new_event_loop()
    gone.close()
    on_loop(gone, never, 10)()
