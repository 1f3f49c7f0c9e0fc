"""ModelStats as JSON and summed: what front-end processes report of the calls they serve and
the parent adds to its versions' statistics."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.inference.jobs import Timings
from service.registry.statistics import ModelStats, StatsError

_counts = st.integers(min_value=0, max_value=1 << 62)


@st.composite
def _stats(draw: st.DrawFn) -> ModelStats:
    stats = ModelStats()
    for _ in range(draw(st.integers(0, 4))):
        timings = Timings(draw(_counts), draw(_counts), draw(_counts))
        stats.record_batch(draw(st.integers(1, 8)), timings)
        stats.record_success(draw(_counts), draw(_counts), draw(_counts), timings)
    for _ in range(draw(st.integers(0, 2))):
        stats.record_failure(draw(_counts))
    stats.last_inference_ms = draw(_counts)
    return stats


def _sum(*parts: ModelStats) -> ModelStats:
    total = ModelStats()
    for part in parts:
        total.add(part)
    return total


@given(_stats())
def test_json_round_trips(stats: ModelStats) -> None:
    data = json.loads(json.dumps(stats.to_json()))
    assert ModelStats.from_json(data) == stats


@given(_stats(), _stats(), _stats())
def test_add_is_associative_and_commutative(a: ModelStats, b: ModelStats, c: ModelStats) -> None:
    left = copy.deepcopy(a)
    left.add(b)
    left.add(c)
    bc = copy.deepcopy(b)
    bc.add(c)
    right = copy.deepcopy(a)
    right.add(bc)
    assert left == right == _sum(c, b, a)


@given(_stats())
def test_adding_nothing_changes_nothing(stats: ModelStats) -> None:
    assert _sum(stats, ModelStats()) == stats


def test_add_sums_counts_and_batch_sizes_and_keeps_the_later_inference() -> None:
    a, b = ModelStats(), ModelStats()
    a.record_batch(2, Timings(1, 10, 100))
    a.record_success(2, 1000, 50, Timings(1, 10, 100))
    b.record_batch(2, Timings(2, 20, 200))
    b.record_batch(4, Timings(3, 30, 300))
    b.record_failure(7)
    a.last_inference_ms, b.last_inference_ms = 500, 400
    a.add(b)
    proto = a.to_proto("m", 1)
    assert (proto.execution_count, proto.inference_count, proto.last_inference) == (3, 2, 500)
    assert (proto.inference_stats.fail.count, proto.inference_stats.fail.ns) == (1, 7)
    sizes = {s.batch_size: (s.compute_infer.count, s.compute_infer.ns) for s in proto.batch_stats}
    assert sizes == {2: (2, 30), 4: (1, 30)}


def _valid() -> dict[str, Any]:
    stats = ModelStats()
    stats.record_batch(2, Timings(1, 2, 3))
    return stats.to_json()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d.__setitem__("inference_count", -1), "inference_count"),
        (lambda d: d.__setitem__("execution_count", 1.5), "execution_count"),
        (lambda d: d.__setitem__("last_inference_ms", True), "last_inference_ms"),
        (lambda d: d["success"].__setitem__("ns", "1"), "success.ns"),
        (lambda d: d.pop("queue"), "stats"),
        (lambda d: d.__setitem__("extra", 1), "stats"),
        (lambda d: d.__setitem__("batches", {}), "batches"),
        (lambda d: d["batches"].append(d["batches"][0]), "batches[1].size"),
        (lambda d: d["batches"][0]["compute_infer"].pop("count"), "batches[0].compute_infer"),
        (lambda d: d.__setitem__("fail", [0, 0]), "fail"),
    ],
)
def test_json_that_is_not_model_stats_is_refused_naming_where(change: Any, named: str) -> None:
    data = _valid()
    change(data)
    with pytest.raises(StatsError, match=f"^{re.escape(named)}:"):
        ModelStats.from_json(data)


def test_json_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(StatsError, match=r"^stats: not an object"):
        ModelStats.from_json([])


@given(_stats(), _stats())
def test_takes_add_up_to_everything_recorded(first: ModelStats, second: ModelStats) -> None:
    live = copy.deepcopy(first)
    taken = live.take()
    assert taken == first and live == ModelStats()
    live.add(second)
    assert _sum(taken, live.take()) == _sum(first, second)
