"""Which models leave memory so that another fits in --model-memory-budget: a decision kept
free of asyncio, processes and clocks (times are inputs), so its order and invariants can be
tested alone (service/lifecycle/budget.py drives it).

The rule, ModelMesh's: the least recently used idle models go first, as few as make room
(one that holds nothing, an ensemble, frees nothing and stays).
A model is idle when nothing holds it: no request in flight or waiting for it, no open
sequence. A pinned model (loaded by RepositoryModelLoad) never goes. When evicting every
idle, unpinned model would still not make room, nothing is evicted and the load is refused
with the reason (the models that hold the rest)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MB = 1 << 20


@dataclass(frozen=True)
class Resident:
    """A model in memory, as the policy sees it."""

    name: str
    bytes: int  # what unloading it frees (budget.py says how it is known)
    last_used: float  # its last request or its load, whichever is later (any one clock)
    pinned: bool = False  # loaded explicitly: never evicted
    busy: bool = False  # requests in flight or waiting, or an open sequence: not evicted now


@dataclass(frozen=True)
class Evict:
    """Unload these, in this order, then load."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class NoRoom:
    """The load cannot fit; nothing is evicted."""

    reason: str


def plan_room(
    residents: Sequence[Resident], needed: int, budget: int, loading: str
) -> Evict | NoRoom:
    """Make room for `needed` bytes of `loading` within `budget` bytes: the least recently
    used idle, unpinned residents (oldest first, ties by name), as few as make room.
    `loading` itself, if resident (a reload), stays and counts as used."""
    if needed > budget:
        return NoRoom(
            f"model '{loading}' needs {_mb(needed)}, more than the whole "
            f"--model-memory-budget of {_mb(budget)}"
        )
    used = sum(r.bytes for r in residents)
    free = budget - used
    chosen: list[str] = []
    candidates = sorted(
        (r for r in residents if r.name != loading and r.bytes and not r.pinned and not r.busy),
        key=lambda r: (r.last_used, r.name),
    )
    for resident in candidates:
        if free >= needed:
            break
        chosen.append(resident.name)
        free += resident.bytes
    if free >= needed:
        return Evict(tuple(chosen))
    held = sorted(r.name for r in residents if r.pinned or r.busy or r.name == loading)
    return NoRoom(
        f"model '{loading}' needs {_mb(needed)} and --model-memory-budget {_mb(budget)} has "
        f"{_mb(max(budget - used, 0))} free; the models in use or pinned hold the rest "
        f"({', '.join(held) or 'none'})"
    )


def _mb(count: int) -> str:
    return f"{count / MB:.1f} MB"
