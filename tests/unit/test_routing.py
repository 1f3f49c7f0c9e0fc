"""Routing: power of two choices on outstanding work, local NUMA node first, spill when the
local instances are clearly busier."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from service.workers.routing import SPILL_MARGIN, choose


@dataclass
class Instance:
    name: str
    outstanding: int
    numa_node: int


def choose_by_outstanding(instances: list[Instance], numa: int, rng: random.Random) -> Instance:
    return choose(instances, numa, rng, lambda instance: instance.outstanding)


def test_two_choices_prefers_the_less_loaded_of_two() -> None:
    idle, busy = Instance("idle", 0, 0), Instance("busy", 5, 0)
    rng = random.Random(1)
    assert {choose_by_outstanding([idle, busy], 0, rng).name for _ in range(20)} == {"idle"}


def test_equal_load_spreads_over_all_instances() -> None:
    instances = [Instance(str(i), 0, 0) for i in range(4)]
    rng = random.Random(2)
    picks = Counter(choose_by_outstanding(instances, 0, rng).name for _ in range(400))
    assert set(picks) == {"0", "1", "2", "3"}


def test_local_numa_node_first_until_it_is_clearly_busier() -> None:
    local, remote = Instance("local", 1, 0), Instance("remote", 0, 1)
    rng = random.Random(3)
    assert choose_by_outstanding([local, remote], 0, rng).name == "local"  # a little busier
    local.outstanding = remote.outstanding + SPILL_MARGIN
    assert choose_by_outstanding([local, remote], 0, rng).name == "remote"  # clearly busier: spill


def test_without_a_local_instance_all_are_candidates() -> None:
    instances = [Instance("a", 3, 1), Instance("b", 0, 1)]
    assert choose_by_outstanding(instances, 0, random.Random(4)).name == "b"
