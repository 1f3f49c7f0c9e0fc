"""pytest plugin for scripts/mutate.py (`-p scripts.mutate_plugin`), in the unmutated run and in
each mutant's: a deterministic hypothesis profile without a database (a failing example saved
for one mutant must not decide another's fate), and, when MUTATE_TRACE_FILE names a source file,
the lines of it each test runs, written as JSON to MUTATE_TRACE_OUT ("" holds the lines run
outside any test: imports, module fixtures) with the tests that were skipped and why."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Generator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from hypothesis import settings

settings.register_profile("mutate", derandomize=True, database=None, deadline=None)
settings.load_profile("mutate")

_TARGET = os.environ.get("MUTATE_TRACE_FILE", "")
_lines: dict[str, set[int]] = {}
_durations: dict[str, float] = {}
_skipped: dict[str, str] = {}  # test -> why (a redis-server that is not installed, say)
_current = ""
_is_target: dict[str, bool] = {}


def _local(frame: FrameType, event: str, arg: Any) -> Any:
    if event == "line":
        _lines.setdefault(_current, set()).add(frame.f_lineno)
    return _local


def _global(frame: FrameType, event: str, arg: Any) -> Any:
    name = frame.f_code.co_filename
    hit = _is_target.get(name)
    if hit is None:
        hit = _is_target[name] = os.path.realpath(name) == _TARGET
    if hit:
        _lines.setdefault(_current, set()).add(frame.f_lineno)
        return _local
    return None


if _TARGET:
    sys.settrace(_global)
    threading.settrace(_global)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    global _current
    _current = item.nodeid
    started = time.monotonic()
    yield
    _durations[item.nodeid] = time.monotonic() - started
    _current = ""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped[report.nodeid] = reason.removeprefix("Skipped: ")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("MUTATE_TRACE_OUT")
    if _TARGET and out:
        sys.settrace(None)
        lines = {test: sorted(hit) for test, hit in _lines.items()}
        report = {"lines": lines, "durations": _durations, "skipped": _skipped}
        Path(out).write_text(json.dumps(report))
