"""The ModelStatistics counts of the calls a front-end process serves itself: kept here per
version, reported to the parent as deltas (`LocalCounts.take`, in each STATS report) and added
there to its versions' own (`add_counts`).

Deltas, not totals: the parent's counts never go down, and a front-end that exits or is
restarted loses at most what it counted since its last report (reports go out every
REPORT_EVERY_S and whenever the parent asks, which it does before it answers ModelStatistics,
so the answer holds every call answered before it was asked for)."""

from __future__ import annotations

from typing import Any

from service.registry.statistics import ModelStats, StatsError
from service.registry.versions import ModelRegistry


class LocalCounts:
    def __init__(self) -> None:
        # One per version for the process's life (versions the parent let it serve: a few).
        self._counts: dict[tuple[str, int], ModelStats] = {}

    def stats(self, model: str, version: int) -> ModelStats:
        """What to record this version's calls into (ModelStats.record_*): the same object
        every time, so it may be kept (as the `stats` of this process's ServedVersion)."""
        counts = self._counts.get((model, version))
        if counts is None:
            counts = self._counts[model, version] = ModelStats()
        return counts

    def take(self) -> list[dict[str, Any]]:
        """What was recorded since the last take, as JSON: {"model", "version", "stats"} per
        version with any; each counts from nothing again."""
        empty = ModelStats()
        return [
            {"model": model, "version": version, "stats": stats.take().to_json()}
            for (model, version), stats in self._counts.items()
            if stats != empty
        ]


def parse_counts(data: object) -> list[tuple[str, int, ModelStats]]:
    """A report's "models" (what `take` wrote), or StatsError: nothing of a report with any
    entry wrong is added."""
    if not isinstance(data, list):
        raise StatsError("models: not a list")
    parsed: list[tuple[str, int, ModelStats]] = []
    for index, entry in enumerate(data):
        where = f"models[{index}]"
        if not isinstance(entry, dict) or set(entry) != {"model", "version", "stats"}:
            raise StatsError(f"{where}: not an object of model, version and stats")
        model, version = entry["model"], entry["version"]
        if not isinstance(model, str):
            raise StatsError(f"{where}.model: not a string")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise StatsError(f"{where}.version: {version!r} is not an integer >= 0")
        try:
            parsed.append((model, version, ModelStats.from_json(entry["stats"])))
        except StatsError as exc:
            raise StatsError(f"{where}.{exc}") from None
    return parsed


def add_counts(models: ModelRegistry, counts: list[tuple[str, int, ModelStats]]) -> None:
    """Each delta added to its version's statistics; one for a version no longer loaded is
    dropped (its statistics are gone with it)."""
    for model, version, stats in counts:
        served = models.serving(model).get(version)
        if served is not None:
            served.stats.add(stats)
