"""What front-end processes report to the parent besides HTTP/3 (reports.py): each report's
frames within the frame limit, applied whole or dropped, and a report the parent asks for
holding every count recorded before the front-end read the question."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from protos.inference import model_config_pb2 as mc
from service.dataplane.plane import DataPlane
from service.dataplane.shared_memory import SharedMemory
from service.frontends.described_call import Serving
from service.frontends.described_infer import DescribedInfer
from service.frontends.descriptors import ViewEntry
from service.frontends.dispatch import DispatchServer
from service.frontends.local_counts import LocalCounts
from service.frontends.model_view import ModelView
from service.frontends.parent_link import ParentLink
from service.frontends.report_sender import ReportPacing
from service.frontends.reports import Reports, report_payloads
from service.frontends.stats import FrontendStats
from service.lifecycle.lifecycle import Lifecycle, LifecycleOptions
from service.lifecycle.repository import ModelRepository
from service.observability.exposition import on_loop
from service.observability.logs import LineBudget, RequestLog
from service.observability.metrics import Metrics
from service.observability.observer import Observer
from service.observability.scrape_bounds import ScrapeLimits
from service.observability.summed import ReportedMetrics, families_json
from service.placement.topology import cpu_only_topology
from service.registry.versions import ModelRegistry, ServedVersion, VersionState
from service.serving.requests import RequestRunner


def _registry() -> tuple[ModelRegistry, ServedVersion]:
    registry = ModelRegistry(lambda: None)
    served = ServedVersion("m", 1, mc.ModelConfig(name="m"), VersionState.READY)
    registry.publish("m", {1: served})
    return registry, served


def _deltas(count: int) -> list[dict[str, Any]]:
    counts = LocalCounts()
    for version in range(count):
        counts.stats("m", version).record_failure(version + 1)
    return counts.take()


def _metrics(series: int = 1) -> list[Any]:
    registry = CollectorRegistry()
    calls = Counter("calls", "calls", ["model"], registry=registry)
    for model in range(series):
        calls.labels(f"m{model}").inc(3)
    return families_json(registry.collect())


def test_a_report_that_fits_goes_as_one_frame() -> None:
    sent = report_payloads({"h3": {"h3": 1}}, _deltas(3), _metrics(), 1 << 20)
    assert len(sent.payloads) == 1 and not sent.left_out
    assert set(json.loads(sent.payloads[0])) == {"h3", "models", "metrics"}


def test_a_report_past_the_frame_limit_is_spread_over_frames_within_it() -> None:
    deltas, metrics = _deltas(40), _metrics()
    whole = report_payloads({"h3": {"h3": 1}}, deltas, metrics, 1 << 20).payloads[0]
    limit = len(whole) // 5
    sent = report_payloads({"h3": {"h3": 1}}, deltas, metrics, limit)
    assert not sent.left_out and len(sent.payloads) > 5
    assert all(len(p) <= limit for p in sent.payloads)
    parts = [json.loads(p) for p in sent.payloads]
    assert [p["h3"] for p in parts if "h3" in p] == [{"h3": 1}]
    assert [p["metrics"] for p in parts if "metrics" in p] == [metrics]
    assert [e for p in parts for e in p.get("models", [])] == deltas


def test_what_is_past_the_frame_limit_alone_is_left_out_and_said() -> None:
    metrics = _metrics(series=50)
    limit = len(json.dumps({"metrics": metrics}, separators=(",", ":"))) - 1
    deltas = _deltas(2)
    sent = report_payloads({}, deltas, metrics, limit)
    assert list(sent.left_out) == ["metrics"]
    assert [e for p in sent.payloads for e in json.loads(p)["models"]] == deltas
    sent = report_payloads({}, _deltas(1), None, 20)
    assert list(sent.left_out) == ["models m version 0"] and sent.payloads == [b"{}"]


def test_a_report_is_applied_whole_or_dropped_whole(caplog: pytest.LogCaptureFixture) -> None:
    registry, served = _registry()
    metrics = ReportedMetrics()
    reports = Reports(FrontendStats(), registry, metrics)
    good = {"model": "m", "version": 1, "stats": _deltas(1)[0]["stats"]}
    bad = {**good, "version": -1}
    with caplog.at_level(logging.ERROR, "paddlequic.frontends"):
        reports.report("a", json.dumps({"models": [good, bad], "metrics": _metrics()}).encode())
    assert "version: -1 is not an integer" in caplog.text
    assert served.stats.fail.count == 0 and metrics.sources() == []
    reports.report("a", json.dumps({"models": [good], "metrics": _metrics()}).encode())
    assert served.stats.fail.count == 1 and len(metrics.sources()) == 1
    reports.report("a", b"[]")  # not an object: dropped too
    reports.retire("a")
    assert [f.name for f in metrics.sources()[0]] == ["calls"]


@dataclass
class _Linked:
    """A parent's dispatch server and a front-end's link to it, over a real unix socket."""

    dispatch: DispatchServer
    link: ParentLink
    registry: ModelRegistry
    served: ServedVersion
    metrics: Metrics  # the parent's


@pytest.fixture
async def linked(tmp_path: Path) -> AsyncIterator[_Linked]:
    registry, served = _registry()
    metrics = Metrics(registry, cpu_only_topology())
    observer = Observer(metrics, RequestLog(0, 0, None, LineBudget(1, 1)), None)
    hello = asyncio.Event()
    dispatch = DispatchServer(
        1 << 20,
        Reports(FrontendStats(), registry, metrics.reported),
        None,
        DescribedInfer(registry, Serving(RequestRunner(registry, observer), observer, None, 1)),
        lambda index: hello.set(),
        sharing=False,
    )
    await dispatch.start(tmp_path / "dispatch")
    reader, writer = await asyncio.open_unix_connection(tmp_path / "dispatch")
    link = ParentLink(0, reader, writer, 1 << 20, None)
    reading = asyncio.create_task(link.run())
    link.hello()
    await hello.wait()
    yield _Linked(dispatch, link, registry, served, metrics)
    writer.close()
    reading.cancel()
    await dispatch.stop()


async def test_a_refresh_holds_every_count_recorded_before_the_question_was_read(
    linked: _Linked,
) -> None:
    link, served = linked.link, linked.served
    refresh = asyncio.create_task(linked.dispatch.refresh_stats())
    await asyncio.sleep(0)  # the question is sent ...
    link.counts.stats("m", 1).record_failure(5)
    link.reports.report()  # ... and crosses a periodic report, sent before it was read
    link.counts.stats("m", 1).record_failure(7)
    await refresh
    assert (served.stats.fail.count, served.stats.fail.ns) == (2, 12)


async def test_model_statistics_asks_the_front_ends_first(linked: _Linked, tmp_path: Path) -> None:
    registry = linked.registry
    observer = Observer(None, RequestLog(0, 0, None, LineBudget(1, 1)), None)
    runner = RequestRunner(registry, observer)
    options = LifecycleOptions("explicit", 0.0, "", False)
    lifecycle = Lifecycle(
        registry, runner, ModelRepository(tmp_path), cpu_only_topology(), options, observer
    )
    plane = DataPlane(registry, runner, lifecycle, "paddlequic", SharedMemory("off"), "explicit")
    plane.refresh_stats = linked.dispatch.refresh_stats
    linked.link.counts.stats("m", 1).record_failure(3)
    (served,) = await plane.statistics("m", "1")
    assert served.stats.to_proto("m", 1).inference_stats.fail.count == 1


async def test_a_scrape_asks_the_front_ends_first_and_sums_their_metrics(linked: _Linked) -> None:
    frontend = Metrics.frontend(linked.link.view.served)
    linked.link.metrics = frontend
    frontend.child(frontend.requests, "m", "1", "h3", "ModelInfer", "OK").inc()
    linked.metrics.child(linked.metrics.requests, "m", "1", "h2", "ModelInfer", "OK").inc(2)
    linked.metrics.refresh = on_loop(asyncio.get_running_loop(), linked.dispatch.refresh_stats, 5)
    server = linked.metrics.serve("127.0.0.1", 0, ScrapeLimits())
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
    finally:
        server.shutdown()
    calls = {
        s.labels["transport"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "paddlequic_requests_total"
    }
    assert calls == {"h2": 2, "h3": 1}


def test_a_front_ends_metrics_label_the_versions_of_its_view_and_leave_process_out() -> None:
    view = ModelView()
    config = mc.ModelConfig(name="m", max_batch_size=4).SerializeToString()
    view.update([ViewEntry("m", "", 7, config), ViewEntry("m", "1", 7, config)])
    metrics = Metrics.frontend(view.served)
    assert view.served() == [("m", "1")]
    assert metrics.names.labels("m", "1") == ("m", "1")
    assert metrics.names.labels("m", "2") == ("m", "_unknown")
    assert metrics.names.labels("other", "") == ("_unknown", "")
    assert not [f for f in metrics.registry.collect() if f.name.startswith("process_")]


@given(steps=st.lists(st.tuples(st.floats(0.0, 40.0), st.integers(0, 3)), min_size=1, max_size=30))
def test_a_periodic_report_goes_out_when_its_counts_moved_or_the_idle_span_passed(
    steps: list[tuple[float, int]],
) -> None:
    """ReportPacing: every change of what a report carries goes out at the next tick; while
    nothing moves, one report per IDLE span and no more."""
    idle = 30.0
    pacing = ReportPacing(idle)
    now, last_moved, last_sent = 0.0, None, -math.inf
    for gap, moved in steps:
        now += gap
        due = pacing.due(now, moved)
        assert due == (moved != last_moved or now - last_sent >= idle)
        if due:
            last_moved, last_sent = moved, now


def test_a_front_ends_calls_seen_move_with_every_call_it_starts_or_ends() -> None:
    """What ReportPacing compares: a call that starts, then one that ends, each moves it."""
    metrics = Metrics.frontend(ModelView().served)
    idle = metrics.calls_seen()
    metrics.child(metrics.inflight, "h2").inc()
    started = metrics.calls_seen()
    metrics.child(metrics.inflight, "h2").dec()
    metrics.child(metrics.requests, "m", "1", "h2", "ModelInfer", "OK").inc()
    assert len({idle, started, metrics.calls_seen()}) == 3
