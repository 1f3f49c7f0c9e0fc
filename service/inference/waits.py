"""Who waits for whom among the worker instances of one process, across every BLS call in flight:
a worker runs one batch at a time, so an instance whose batch waits on a BLS call runs nothing
else until the call is answered, and a batch sent to an instance waits for the batches before
it there. A call that only instances waiting on it could ever serve, directly or through a
cycle of other calls, would wait for its deadline: the request path asks `blocks` first and
refuses it at once (service/serving/bls.py), and the batcher never sends a batch where it
would wait for itself (service/serving/batch_runner.py).

An instance is free once each of its waits is over, and a wait is over once one of the
instances it is on is free (any instance of a call's target model may run the call; a batch
already sent to an instance waits on that one alone). Instances that are never free are
stuck: the greatest set in which every member has a wait on members only."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Wait:
    """`waiter`'s running batch cannot end before one of the instances `on` runs what it waits
    for (instances are named by their ids, as in CallChain.waiting)."""

    waiter: int
    on: frozenset[int]


def stuck(waits: Iterable[Wait]) -> frozenset[int]:
    """The waiters that can never run again, whatever the order the others run in."""
    by_waiter: dict[int, list[frozenset[int]]] = {}
    for wait in waits:
        by_waiter.setdefault(wait.waiter, []).append(wait.on)
    blocked = set(by_waiter)
    changed = True
    while changed:
        changed = False
        for waiter in list(blocked):
            if all(not on <= blocked for on in by_waiter[waiter]):
                blocked.discard(waiter)
                changed = True
    return frozenset(blocked)


class WaitGraph:
    """The waits in flight in one process (the one that runs the workers and their calls)."""

    def __init__(self) -> None:
        self._waits: dict[int, tuple[Wait, ...]] = {}
        self._tokens = itertools.count()

    def blocks(self, waits: tuple[Wait, ...]) -> bool:
        """Whether one of `waits`' waiters could never run again once they are added. When
        none could, no instance free before is stuck after: a wait only holds its waiter."""
        if not waits:
            return False
        never = stuck(itertools.chain(itertools.chain.from_iterable(self._waits.values()), waits))
        return any(w.waiter in never for w in waits)

    @contextmanager
    def added(self, waits: tuple[Wait, ...]) -> Iterator[None]:
        """The waits, held for the block."""
        if not waits:
            yield
            return
        token = next(self._tokens)
        self._waits[token] = waits
        try:
            yield
        finally:
            del self._waits[token]

    def __len__(self) -> int:
        return len(self._waits)
