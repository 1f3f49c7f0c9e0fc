"""Python models' custom metrics (Triton's pb_utils.MetricFamily / Metric) in the front-end:
families are the server's, as in Triton (a family of the same name and kind from another
instance or model is the same family), exported beside the server's own families.

A worker runs untrusted model.py, which could send any update: each is checked again here, and
what one model may hold is bounded (families and label sets per model, labels per metric,
text lengths, buckets); an update beyond a bound, or that contradicts its family (another
kind, description or buckets), is refused and logged once per model and reason, changing
nothing. Pure bookkeeping, read by the metrics endpoint's collector on scrape."""

from __future__ import annotations

import logging
import math
import re
import threading
from dataclasses import dataclass, field

from service.backend.python_runtime import triton_python_backend_utils as pb_utils
from service.workers.protocol import MetricUpdate

log = logging.getLogger("paddlequic.models")

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_KINDS = (
    pb_utils.MetricFamily.COUNTER,
    pb_utils.MetricFamily.GAUGE,
    pb_utils.MetricFamily.HISTOGRAM,
)
_OPS = ("family", "metric", "increment", "set", "observe")
Labels = tuple[tuple[str, str], ...]


@dataclass
class Series:
    """One label set's state: a counter's or gauge's value, or a histogram's bucket counts
    (cumulative ones are made on export), sum and count."""

    buckets: tuple[float, ...]
    value: float = 0.0
    counts: list[int] = field(default_factory=list)
    count: int = 0


@dataclass
class Family:
    name: str
    kind: str
    description: str
    series: dict[Labels, Series] = field(default_factory=dict)
    owners: set[str] = field(default_factory=set)  # models that declared it


class CustomMetrics:
    def __init__(
        self,
        max_families: int = pb_utils.MAX_METRIC_FAMILIES,
        max_series: int = pb_utils.MAX_METRICS,
    ) -> None:
        """Bounds per model: families it declares, label sets it creates over all of them."""
        self.max_families = max_families
        self.max_series = max_series
        self._families: dict[str, Family] = {}
        self._series_of: dict[str, int] = {}  # per model
        self._families_of: dict[str, int] = {}
        self._lock = threading.Lock()  # the collector reads from the HTTP server's thread
        self._warned: set[tuple[str, str]] = set()
        self.refused = 0

    def apply(self, model: str, update: MetricUpdate) -> str | None:
        """Apply one update of `model`'s; the reason it was refused, or None."""
        with self._lock:
            reason = self._apply(model, update)
        if reason is not None:
            self.refused += 1
            if (model, reason) not in self._warned and len(self._warned) < 1024:
                self._warned.add((model, reason))
                log.warning("model %s: metric update refused: %s", model, reason)
        return reason

    def families(self) -> list[Family]:
        """A copy for export (and the collector's thread): every family and series."""
        with self._lock:
            return [
                Family(
                    f.name,
                    f.kind,
                    f.description,
                    {
                        k: Series(s.buckets, s.value, list(s.counts), s.count)
                        for k, s in f.series.items()
                    },
                    set(f.owners),
                )
                for f in self._families.values()
            ]

    def _apply(self, model: str, u: MetricUpdate) -> str | None:
        problem = _malformed(u)
        if problem is not None:
            return problem
        family = self._families.get(u.family)
        if family is None:
            if self._families_of.get(model, 0) >= self.max_families:
                return f"more than {self.max_families} metric families for one model"
            family = self._families[u.family] = Family(u.family, u.kind, u.description)
        if family.kind != u.kind:
            return f"family {u.family!r} is a {family.kind}, not a {u.kind}"
        if model not in family.owners:
            if self._families_of.get(model, 0) >= self.max_families:
                return f"more than {self.max_families} metric families for one model"
            family.owners.add(model)
            self._families_of[model] = self._families_of.get(model, 0) + 1
        if u.op == "family":
            return None
        series = family.series.get(u.labels)
        if series is None:
            if self._series_of.get(model, 0) >= self.max_series:
                return f"more than {self.max_series} metrics (label sets) for one model"
            self._series_of[model] = self._series_of.get(model, 0) + 1
            series = family.series[u.labels] = Series(u.buckets, counts=[0] * (len(u.buckets) + 1))
        if series.buckets != u.buckets:
            return f"family {u.family!r} has buckets {list(series.buckets)} for these labels"
        if u.op == "increment":
            series.value += u.value
        elif u.op == "set":
            series.value = u.value
        elif u.op == "observe":
            index = next(
                (i for i, b in enumerate(series.buckets) if u.value <= b), len(series.buckets)
            )
            series.counts[index] += 1
            series.count += 1
            series.value += u.value
        return None


def _malformed(u: MetricUpdate) -> str | None:
    """What the worker should have refused (a model that wrote its own messages)."""
    texts = [u.family, u.description, *(t for pair in u.labels for t in pair)]
    if not all(isinstance(t, str) for t in texts) or not isinstance(u.value, float):
        return "an update of the wrong types"
    if u.kind not in _KINDS or u.op not in _OPS:
        return f"unknown kind {u.kind!r} or operation {u.op!r}"
    if not _NAME.fullmatch(u.family) or u.family.startswith(pb_utils.RESERVED_PREFIXES):
        return f"family name {u.family[: pb_utils.MAX_METRIC_TEXT]!r} is not allowed"
    if len(u.family) > pb_utils.MAX_METRIC_TEXT or len(u.description) > pb_utils.MAX_DESCRIPTION:
        return "a family name or description too long"
    if len(u.labels) > pb_utils.MAX_LABELS or any(
        not _LABEL.fullmatch(k)
        or len(k) > pb_utils.MAX_METRIC_TEXT
        or len(v) > pb_utils.MAX_METRIC_TEXT
        for k, v in u.labels
    ):
        return f"labels beyond {pb_utils.MAX_LABELS} names of Prometheus' form"
    if len({k for k, _ in u.labels}) != len(u.labels):
        return "a label named twice"
    if not math.isfinite(u.value):
        return "a value that is not finite"
    buckets = u.buckets
    if (u.kind == pb_utils.MetricFamily.HISTOGRAM) != bool(buckets) or len(
        buckets
    ) > pb_utils.MAX_BUCKETS:
        return f"a histogram needs 1 to {pb_utils.MAX_BUCKETS} buckets, others none"
    if not all(isinstance(b, float) and math.isfinite(b) for b in buckets) or list(
        buckets
    ) != sorted(set(buckets)):
        return "buckets that are not increasing finite numbers"
    allowed = {
        pb_utils.MetricFamily.COUNTER: ("family", "metric", "increment"),
        pb_utils.MetricFamily.GAUGE: ("family", "metric", "increment", "set"),
        pb_utils.MetricFamily.HISTOGRAM: ("family", "metric", "observe"),
    }[u.kind]
    if u.op not in allowed or (u.kind == pb_utils.MetricFamily.COUNTER and u.value < 0):
        return f"{u.op} of a {u.kind}"
    return None


# The front-end's one set of families, as Triton's server has one.
SERVER_METRICS = CustomMetrics()
