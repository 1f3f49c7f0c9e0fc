"""A front-end's counts of the calls it serves itself: taken as deltas, parsed and added by
the parent to the versions it serves."""

from __future__ import annotations

import json

import pytest

from protos.inference import model_config_pb2 as mc
from service.frontends.local_counts import LocalCounts, add_counts, parse_counts
from service.inference.jobs import Timings
from service.registry.statistics import ModelStats, StatsError
from service.registry.versions import ModelRegistry, ServedVersion, VersionState


def _served(registry: ModelRegistry, name: str, version: int) -> ServedVersion:
    served = ServedVersion(name, version, mc.ModelConfig(name=name), VersionState.READY)
    registry.publish(name, {**registry.serving(name), version: served})
    return served


def test_take_gives_what_was_recorded_since_the_last_take() -> None:
    counts = LocalCounts()
    counts.stats("m", 1).record_failure(5)
    counts.stats("m", 1).record_failure(7)
    counts.stats("n", 2).record_batch(4, Timings(1, 2, 3))
    counts.stats("idle", 1)  # asked for, nothing recorded: not reported
    taken = counts.take()
    assert [(e["model"], e["version"]) for e in taken] == [("m", 1), ("n", 2)]
    assert taken[0]["stats"]["fail"] == {"count": 2, "ns": 12}
    assert counts.take() == []
    kept = counts.stats("m", 1)  # as a front-end's ServedVersion keeps it, across takes
    kept.record_failure(1)
    (again,) = counts.take()
    assert again["stats"]["fail"] == {"count": 1, "ns": 1}
    kept.record_failure(2)
    (later,) = counts.take()
    assert later["stats"]["fail"] == {"count": 1, "ns": 2}


def test_deltas_add_up_in_the_parent_to_every_call_recorded() -> None:
    registry = ModelRegistry(lambda: None)
    served = _served(registry, "m", 1)
    served.stats.record_failure(100)  # the parent's own
    counts = LocalCounts()
    for ns in (1, 2, 3):
        counts.stats("m", 1).record_failure(ns)
        add_counts(registry, parse_counts(json.loads(json.dumps(counts.take()))))
    assert (served.stats.fail.count, served.stats.fail.ns) == (4, 106)


def test_a_delta_for_a_version_not_loaded_is_dropped() -> None:
    registry = ModelRegistry(lambda: None)
    served = _served(registry, "m", 1)
    other = ModelStats()
    other.record_failure(1)
    add_counts(registry, [("m", 2, other), ("gone", 1, other), ("m", 1, other)])
    assert served.stats.fail.count == 1
    registry.withdraw("m")
    add_counts(registry, [("m", 1, other)])
    assert served.stats.fail.count == 1


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({}, "models"),
        ([{"model": "m", "version": 1}], r"models\[0\]"),
        ([{"model": 1, "version": 1, "stats": ModelStats().to_json()}], r"models\[0\].model"),
        ([{"model": "m", "version": -1, "stats": ModelStats().to_json()}], r"models\[0\].version"),
        ([{"model": "m", "version": 1, "stats": {}}], r"models\[0\].stats"),
    ],
)
def test_a_malformed_report_is_refused_whole(data: object, named: str) -> None:
    with pytest.raises(StatsError, match=f"^{named}:"):
        parse_counts(data)
