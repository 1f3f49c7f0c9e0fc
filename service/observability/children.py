"""Labelled metric children, looked up once: prometheus_client's `labels()` takes a lock and
validates the labels on every call, which shows on the per-request path."""

from __future__ import annotations

from typing import Any


class Children:
    """`children(metric, *labels)` is `metric.labels(*labels)`, made once per label values."""

    def __init__(self) -> None:
        self._found: dict[tuple[int, tuple[str, ...]], Any] = {}

    def __call__(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), labels)
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = metric.labels(*labels)
        return found
