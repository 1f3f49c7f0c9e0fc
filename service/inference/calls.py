"""BLS (a Python model calling another model): the chain of calls a request was made by, which
the request path checks so that a model calling itself in a loop gets an error, never a hang."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# How deep BLS calls may nest: a client's request is depth 0, a call its model makes depth 1.
BLS_MAX_DEPTH = 4


@dataclass(frozen=True)
class CallChain:
    """How deep in BLS calls a request is, and the worker instances (their ids) that are
    blocked until it is answered, each running one of its callers: a call that could only run
    on those would wait for itself."""

    depth: int = 0
    waiting: frozenset[int] = frozenset()

    def called_from(self, instance: int) -> CallChain:
        """The chain of a call that a batch with this chain makes from `instance`."""
        return CallChain(self.depth + 1, self.waiting | {instance})


# A client's request: no caller.
ROOT = CallChain()


def joined(chains: Iterable[CallChain]) -> CallChain:
    """The chain of a batch: a call it makes keeps every request in it, and their callers,
    waiting."""
    depth, waiting = 0, frozenset[int]()
    for chain in chains:
        depth = max(depth, chain.depth)
        waiting |= chain.waiting
    return CallChain(depth, waiting) if waiting else ROOT
