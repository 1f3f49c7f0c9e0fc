"""The short abuse suite: each attack, small and brief, against one live server while good
clients call on both transports; each row must meet the goal."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest

from tests.chaos.harness import SHORT, AttackSpec, Target, chaos_server, run_row
from tests.chaos.registry import ATTACKS


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    with chaos_server(tmp_path_factory.mktemp("chaos")) as served:
        yield served


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(
            spec,
            id=re.sub(r"[^A-Za-z0-9]+", "-", spec.name),
            marks=[pytest.mark.xfail(strict=False, reason=spec.pending)] if spec.pending else [],
        )
        for spec in ATTACKS
    ],
)
def test_attack_meets_the_goal(target: Target, spec: AttackSpec) -> None:
    row = asyncio.run(run_row(target, spec, SHORT))
    assert row.passed, row.explain()
