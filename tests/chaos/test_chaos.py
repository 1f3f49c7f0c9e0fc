"""The short abuse suite: each attack, small and brief, against one live server while good
clients call on both transports; each row must meet the goal."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import Executor
from typing import NamedTuple

import pytest

from tests.chaos.harness import (
    SHORT,
    AttackSpec,
    Target,
    attacker_process,
    chaos_server,
    run_row,
)
from tests.chaos.registry import ATTACKS
from tests.servers import ServerProcess


class Chaos(NamedTuple):
    server: ServerProcess
    target: Target
    attacker: Executor


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    with chaos_server(tmp_path_factory.mktemp("chaos")) as served, attacker_process() as pool:
        yield Chaos(*served, pool)


@pytest.fixture(scope="module")
def chaos_frontends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    """The server of the rows that attack front-end processes: --frontends 2."""
    with (
        chaos_server(tmp_path_factory.mktemp("chaos"), frontends=2) as served,
        attacker_process() as pool,
    ):
        yield Chaos(*served, pool)


@pytest.fixture(scope="module")
def chaos_batcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    """The server of the rows that attack the server's own batcher (--no-instance-queues)."""
    with (
        chaos_server(tmp_path_factory.mktemp("chaos"), batcher=True) as served,
        attacker_process() as pool,
    ):
        yield Chaos(*served, pool)


@pytest.mark.parametrize(
    "spec",
    [pytest.param(spec, id=re.sub(r"[^A-Za-z0-9]+", "-", spec.name)) for spec in ATTACKS],
)
async def test_attack_meets_the_goal(request: pytest.FixtureRequest, spec: AttackSpec) -> None:
    fixture = (
        "chaos_batcher" if spec.batcher else "chaos" if spec.frontends == 1 else "chaos_frontends"
    )
    chaos: Chaos = request.getfixturevalue(fixture)
    row = await run_row(chaos.server, chaos.target, spec, SHORT, chaos.attacker)
    assert row.passed, row.explain()
