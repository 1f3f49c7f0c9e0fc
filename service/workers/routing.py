"""Which instance gets the next batch: power of two choices on outstanding work (as the caller
weighs it: `load`), instances on the front-end's NUMA node first, spilling to remote ones when
the local ones are clearly busier. Pure, so its choices can be tested without worker
processes."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

SPILL_MARGIN = 2  # remote instances take work once the local ones hold this much more


class Routable(Protocol):
    @property
    def numa_node(self) -> int: ...


R = TypeVar("R", bound=Routable)


def choose(
    instances: Sequence[R], local_numa: int | None, rng: random.Random, load: Callable[[R], int]
) -> R:
    local = [i for i in instances if i.numa_node == local_numa]
    remote = [i for i in instances if i.numa_node != local_numa]
    if not local or not remote:
        return _two_choices(local or remote, rng, load)
    near, far = _two_choices(local, rng, load), _two_choices(remote, rng, load)
    return far if load(near) >= load(far) + SPILL_MARGIN else near


def _two_choices(instances: Sequence[R], rng: random.Random, load: Callable[[R], int]) -> R:
    if len(instances) == 1:
        return instances[0]
    first, second = rng.sample(list(instances), 2)
    return first if load(first) <= load(second) else second
