"""/metrics of a server with front-end processes: each front-end reports its own families
(the calls it serves itself, counted where they run), and the parent writes, per family, its
own samples with every front-end's added: the same sample name and labels summed, a `_created`
sample the earliest. An exited front-end's counters and histograms stay in the sums (they never
go down); its gauges (what it had in flight) go with it.

Families travel as JSON of the collector's own objects (`families_json`): for some 1,300
samples, 3 ms to collect and 1.5 ms to write, 1.3 ms to read back, where the OpenMetrics text
took 16 ms to write and prometheus_client's parser 37 ms to read, on the parent's event loop."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

# Kinds whose samples add up across processes: an exited process's stay in the sums.
KEPT = frozenset(("counter", "histogram", "summary"))
# Kinds that add up across running processes only.
LIVE = frozenset(("gauge",))
_CREATED = "_created"

Key = tuple[str, tuple[tuple[str, str], ...]]


def families_json(families: Iterable[Metric]) -> list[list[Any]]:
    """[name, kind, help, [[sample name, labels, value], ...]] per family of a kind that sums."""
    return [
        [f.name, f.type, f.documentation, [[s.name, s.labels, s.value] for s in f.samples]]
        for f in families
        if f.type in KEPT | LIVE
    ]


def families_from_json(data: object) -> list[Metric]:
    """What families_json wrote, or ValueError naming what is wrong."""
    if not isinstance(data, list):
        raise ValueError("metrics: not a list")
    families: list[Metric] = []
    for index, entry in enumerate(data):
        where = f"metrics[{index}]"
        if not (isinstance(entry, list) and len(entry) == 4):
            raise ValueError(f"{where}: not [name, kind, help, samples]")
        name, kind, documentation, samples = entry
        if not (isinstance(name, str) and isinstance(documentation, str)):
            raise ValueError(f"{where}: name and help must be strings")
        if kind not in KEPT | LIVE:
            raise ValueError(f"{where}: kind {kind!r} does not sum")
        if not isinstance(samples, list):
            raise ValueError(f"{where}: samples not a list")
        family = Metric(name, documentation, kind)
        family.samples = [_sample(sample, f"{where}.samples") for sample in samples]
        families.append(family)
    return families


def _sample(data: object, where: str) -> Sample:
    if not (isinstance(data, list) and len(data) == 3):
        raise ValueError(f"{where}: a sample is not [name, labels, value]")
    name, labels, value = data
    if not isinstance(name, str):
        raise ValueError(f"{where}: a sample's name is not a string")
    if not (
        isinstance(labels, dict)
        and all(isinstance(v, str) for v in labels.values())  # JSON keys are strings
    ):
        raise ValueError(f"{where}: {name}'s labels are not strings")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: {name}'s value is not a number")
    return Sample(name, labels, float(value))


def sum_families(own: Iterable[Metric], others: Iterable[Iterable[Metric]]) -> list[Metric]:
    """`own`'s families, in order, with `others`' samples added (new series and families
    after them). A family of a kind that does not sum, or of another kind than a family of the
    same name already has, is left out."""
    families: dict[str, Metric] = {}
    samples: dict[str, dict[Key, Sample]] = {}
    for family in own:
        families[family.name] = family
        samples[family.name] = {_key(s): s for s in family.samples}
    for source in others:
        for family in source:
            known = families.get(family.name)
            if family.type not in KEPT | LIVE or (known is not None and known.type != family.type):
                continue
            if known is None:
                families[family.name] = family
                samples[family.name] = {}
            into = samples[family.name]
            for sample in family.samples:
                key = _key(sample)
                if key not in into:
                    into[key] = Sample(sample.name, sample.labels, sample.value)
                else:
                    into[key] = into[key]._replace(value=_added(sample, into[key].value))
    summed: list[Metric] = []
    for name, family in families.items():
        out = Metric(family.name, family.documentation, family.type, family.unit)
        out.samples = list(samples[name].values())
        summed.append(out)
    return summed


def _key(sample: Sample) -> Key:
    return sample.name, tuple(sorted(sample.labels.items()))


def _added(sample: Sample, value: float) -> float:
    if sample.name.endswith(_CREATED):
        return min(value, sample.value)
    return value + sample.value


class ReportedMetrics:
    """Every front-end's latest families, and those of the front-ends that exited. Read from
    the metrics server's thread: both are replaced, never changed in place."""

    def __init__(self) -> None:
        self._live: dict[object, list[Metric]] = {}
        self._retired: list[Metric] = []

    def report(self, source: object, families: list[Metric]) -> None:
        self._live = {**self._live, source: families}

    def retire(self, source: object) -> None:
        """`source` exited: its counters and histograms kept, its gauges dropped."""
        live = dict(self._live)
        last = live.pop(source, None)
        if last is not None:
            kept = [f for f in last if f.type in KEPT]
            self._retired = sum_families(self._retired, [kept])
        self._live = live

    def sources(self) -> list[list[Metric]]:
        """The families to add to the parent's own (none: no front-end reported any)."""
        return [s for s in (self._retired, *self._live.values()) if s]


class Summed(Collector):
    """`own`'s families with the front-ends' added; exactly `own`'s when none reported."""

    def __init__(self, own: Collector, reported: ReportedMetrics) -> None:
        self._own = own
        self._reported = reported

    def collect(self) -> Iterator[Metric]:
        sources = self._reported.sources()
        if not sources:
            yield from self._own.collect()
            return
        yield from sum_families(self._own.collect(), sources)


class Restricted(Collector):
    """Only the samples named (`?name[]=`), as prometheus_client's restricted registry."""

    def __init__(self, collector: Collector, names: Collection[str]) -> None:
        self._collector = collector
        self._names = names

    def collect(self) -> Iterator[Metric]:
        for family in self._collector.collect():
            samples = [s for s in family.samples if s.name in self._names]
            if samples:
                out = Metric(family.name, family.documentation, family.type, family.unit)
                out.samples = samples
                yield out
