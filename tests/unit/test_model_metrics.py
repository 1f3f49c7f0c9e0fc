"""Python models' custom metrics in the front-end (service/workers/model_metrics.py): updates
as a hostile worker could write them, checked again and bounded per model."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from service.workers.model_metrics import CustomMetrics
from service.workers.protocol import MetricUpdate

KINDS = ("counter", "gauge", "histogram")
OPS = ("family", "metric", "increment", "set", "observe")
updates = st.builds(
    MetricUpdate,
    family=st.sampled_from(["a", "b", "c", "d", "paddlequic_x", "1bad"]),
    kind=st.sampled_from([*KINDS, "summary"]),
    description=st.just("d"),
    labels=st.lists(
        st.tuples(st.sampled_from(["k", "l", "0"]), st.sampled_from(["1", "2", "3"])), max_size=2
    ).map(tuple),
    buckets=st.sampled_from([(), (1.0,), (1.0, 2.0), (2.0, 1.0), (math.nan,)]),
    op=st.sampled_from([*OPS, "reset"]),
    value=st.sampled_from([0.0, 1.5, -1.0, math.inf]),
)


@given(st.lists(st.tuples(st.sampled_from(["m", "n"]), updates), max_size=60))
def test_what_a_model_holds_stays_within_its_bounds(sent: list[tuple[str, MetricUpdate]]) -> None:
    metrics = CustomMetrics(max_families=2, max_series=3)
    refused = 0
    for model, update in sent:
        refused += metrics.apply(model, update) is not None
    assert metrics.refused == refused
    families = metrics.families()
    for model in ("m", "n"):
        # Each model's share: families it declared, label sets it created.
        assert sum(1 for f in families if model in f.owners) <= 2
    assert sum(len(f.series) for f in families) <= 2 * 3
    for family in families:
        assert family.kind in KINDS and not family.name.startswith("paddlequic_")
        for series in family.series.values():
            assert math.isfinite(series.value)
            if family.kind == "counter":
                assert series.value >= 0


def test_a_family_keeps_its_kind_and_a_refusal_names_the_bound() -> None:
    metrics = CustomMetrics(max_families=1, max_series=1)
    counter = MetricUpdate("hits", "counter", "d", (("k", "v"),), (), "increment", 2.0)
    assert metrics.apply("m", counter) is None
    assert "is a counter" in (metrics.apply("n", replace(counter, kind="gauge", op="set")) or "")
    assert "more than 1 metric families" in (metrics.apply("m", replace(counter, family="x")) or "")
    assert "more than 1 metrics" in (metrics.apply("m", replace(counter, labels=())) or "")
    (family,) = metrics.families()
    assert family.series[(("k", "v"),)].value == 2.0
