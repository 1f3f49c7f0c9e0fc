"""Which instance gets the next batch: power of two choices on outstanding work, instances on
the front-end's NUMA node first, spilling to remote ones when the local ones are clearly busier.
Pure, so its choices can be tested without worker processes."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol, TypeVar

SPILL_MARGIN = 2  # remote instances take work once the local ones hold this much more


class Routable(Protocol):
    @property
    def outstanding(self) -> int: ...

    @property
    def numa_node(self) -> int: ...


R = TypeVar("R", bound=Routable)


def choose(instances: Sequence[R], local_numa: int | None, rng: random.Random) -> R:
    local = [i for i in instances if i.numa_node == local_numa]
    remote = [i for i in instances if i.numa_node != local_numa]
    if not local or not remote:
        return _two_choices(local or remote, rng)
    near, far = _two_choices(local, rng), _two_choices(remote, rng)
    return far if near.outstanding >= far.outstanding + SPILL_MARGIN else near


def _two_choices(instances: Sequence[R], rng: random.Random) -> R:
    if len(instances) == 1:
        return instances[0]
    first, second = rng.sample(list(instances), 2)
    return first if first.outstanding <= second.outstanding else second
