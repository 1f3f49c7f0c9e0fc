"""The Grafana dashboard imports as is and queries only metrics the server exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.observability.metrics import Metrics
from service.placement.topology import cpu_only_topology
from service.registry.versions import ModelRegistry

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "paddlequic.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# Sample names Prometheus shows for each metric type (the family name plus these).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
}
# PromQL functions and aggregations the dashboard may call; anything else followed by "(" is
# a typo (or a function this list should learn).
FUNCTIONS = {
    "sum", "avg", "min", "max", "count", "topk", "bottomk", "rate", "irate", "increase",
    "histogram_quantile", "clamp_min", "clamp_max", "abs", "vector", "scalar",
}  # fmt: skip
KEYWORDS = {"and", "or", "unless", "bool", "offset"}
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def exported_metric_names() -> set[str]:
    """Every sample name the server's registry can export, from a registry built as serve
    builds it, including families only a server with HTTP/3 or GPUs yields."""
    topology = cpu_only_topology()
    metrics = Metrics(ModelRegistry(lambda: None), topology)
    families = [*metrics.registry.collect(), *metrics.state.describe()]
    return {f.name + suffix for f in families for suffix in SUFFIXES[f.type]}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a parser for the subset dashboards use)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values can hold anything
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"(?<![\w:])\d+(?:\.\d+)?(?:ms|[smhdwy])?", " ", text)  # numbers, durations
    names: set[str] = set()
    for match in _IDENTIFIER.finditer(text):
        word = match.group()
        if text[match.end() :].lstrip().startswith("("):
            assert word in FUNCTIONS, f"unknown PromQL function {word!r} in {expr}"
        elif word not in KEYWORDS:
            names.add(word)
    return names


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_every_query_names_exported_metrics(dashboard: dict[str, Any]) -> None:
    exported = exported_metric_names()
    queried: set[str] = set()
    for panel in panels(dashboard):
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, f"panel {panel['title']!r}: no metric in {target['expr']}"
            unknown = names - exported
            assert not unknown, f"panel {panel['title']!r} queries {unknown}, not exported"
            queried |= names
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # Grafana's label_values(METRIC, LABEL)
            found = re.fullmatch(r"label_values\((\w+), *\w+\)", variable["definition"])
            assert found and found.group(1) in exported, variable["definition"]
    assert "paddlequic_gpu_memory_used_bytes" in queried  # a GPU-only family is checked too


def test_the_parser_finds_metrics_and_rejects_unknown_functions() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (model, le) (rate(a_bucket{rpc=~"x|y(z)"}[5m])))'
        " / on (model) b_total offset 5m"
    )
    assert metric_names(expr) == {"a_bucket", "b_total"}
    with pytest.raises(AssertionError, match="unknown PromQL function 'ratee'"):
        metric_names("ratee(a_total[5m])")


def test_importable_with_a_prometheus_datasource(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"] == DATASOURCE
        assert all(t["datasource"] == DATASOURCE for t in panel["targets"])
    titles = {p["title"] for p in panels(dashboard)}
    for wanted in (
        "Requests/s by model and transport",
        "P50 / P99 latency",
        "Queue vs compute time (mean)",
        "Mean batch size",
        "0-RTT share of HTTP/3 handshakes",
        "Worker restarts",
        "Model load failures",
        "GPU memory used",
    ):
        assert wanted in titles
