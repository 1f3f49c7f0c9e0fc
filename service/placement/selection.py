"""Choosing GPUs for one instance: filter, then score; for multi-GPU instances, choose the set.

Single GPU: score = W_FREE * free/most free + W_IDLE * (1 - utilization) + W_LOCAL * (same NUMA
node as the front-end) - W_SPREAD * instances this placement already put there. Ties go to the
lower index.

GPU sets, compared in this order (first difference wins):
1. the worst link between two members (Link.score: NVLink count, then PCIe level),
2. all members on one known NUMA node,
3. the sum of all member links,
4. fewer instances already placed on the members (spread),
5. anti-fragmentation: the link score left among the candidate GPUs still unused by this
   placement once the set is taken (so a set that cuts through a good pair or quad loses to one
   that takes a whole pair and leaves the others intact, like the NVIDIA device plugin's
   best-effort policy),
6. the members' single-GPU scores (without spread),
7. lower indices.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from service.placement.topology import Gpu, Topology

W_FREE = 1.0
W_IDLE = 1.0
W_LOCAL = 0.5
W_SPREAD = 1.0
UNKNOWN_IDLE = 0.5  # utilization unknown: neither busy nor idle
MAX_SET_CANDIDATES = 20_000  # above this, sets are grown greedily from each GPU
GIB = float(1 << 30)

SetKey = tuple[int, bool, int, int, int, float, tuple[int, ...]]


def gib(size: int) -> str:
    return f"{size / GIB:.1f} GiB"


@dataclass
class Ledger:
    """What this placement call has put on each GPU so far."""

    topology: Topology
    frontend_numa: int | None
    placed: list[int] = field(init=False, default_factory=list)  # instances per GPU index
    reserved: list[int] = field(init=False, default_factory=list)  # bytes per GPU index

    def __post_init__(self) -> None:
        self.placed = [0] * len(self.topology.gpus)
        self.reserved = [0] * len(self.topology.gpus)

    def free(self, gpu: Gpu) -> int:
        return gpu.memory_free_bytes - self.reserved[gpu.index]

    def take(self, indices: Sequence[int], need: int) -> None:
        for index in indices:
            self.placed[index] += 1
            self.reserved[index] += need

    def why_not(self, gpu: Gpu, need: int, allow_mig: bool) -> str | None:
        """Why `gpu` cannot take an instance needing `need` bytes; None if it can."""
        if not gpu.healthy:
            return f"unhealthy ({gpu.health_detail or 'reported unhealthy'})"
        if gpu.mig_enabled and not allow_mig:
            return "MIG mode enabled and the model does not allow MIG"
        free = self.free(gpu)
        if free < need:
            taken = self.reserved[gpu.index]
            after = f" after {gib(taken)} for instances placed before" if taken else ""
            return f"{gib(free)} free{after} < {gib(need)} needed"
        return None

    def score(self, gpu: Gpu, most_free: int) -> float:
        """The single-GPU score without spread."""
        idle = (
            UNKNOWN_IDLE if gpu.utilization_percent is None else 1 - gpu.utilization_percent / 100
        )
        local = self.frontend_numa is not None and gpu.numa_node == self.frontend_numa
        return W_FREE * self.free(gpu) / max(most_free, 1) + W_IDLE * idle + W_LOCAL * local

    def describe(self, gpu: Gpu) -> str:
        util = "?" if gpu.utilization_percent is None else f"{gpu.utilization_percent}%"
        numa = "?" if gpu.numa_node < 0 else str(gpu.numa_node)
        if self.frontend_numa is not None and gpu.numa_node >= 0:
            numa += " local" if gpu.numa_node == self.frontend_numa else " remote"
        text = f"GPU {gpu.index}: {gib(self.free(gpu))} free, util {util}, NUMA {numa}"
        placed = self.placed[gpu.index]
        return text + (f", {placed} instance(s) placed there before" if placed else "")


def best_gpu(ledger: Ledger, candidates: Sequence[Gpu]) -> Gpu:
    most_free = max(ledger.free(gpu) for gpu in candidates)
    return max(
        candidates,
        key=lambda gpu: (
            round(ledger.score(gpu, most_free) - W_SPREAD * ledger.placed[gpu.index], 6),
            -gpu.index,
        ),
    )


def best_set(ledger: Ledger, candidates: Sequence[Gpu], size: int) -> tuple[Gpu, ...]:
    topology = ledger.topology
    most_free = max(ledger.free(gpu) for gpu in candidates)
    unused = [gpu.index for gpu in candidates if ledger.placed[gpu.index] == 0]
    strength = {i: sum(topology.link(i, j).score for j in unused if j != i) for i in unused}
    unused_total = sum(strength.values()) // 2

    def key(members: Sequence[Gpu]) -> SetKey:
        indices = [gpu.index for gpu in members]
        links = [topology.link(i, j).score for i, j in itertools.combinations(indices, 2)]
        nodes = {gpu.numa_node for gpu in members}
        taken = [i for i in indices if i in strength]
        inner = sum(topology.link(i, j).score for i, j in itertools.combinations(taken, 2))
        left = unused_total - sum(strength[i] for i in taken) + inner
        return (
            min(links),
            len(nodes) == 1 and min(nodes) >= 0,
            sum(links),
            -sum(ledger.placed[i] for i in indices),
            left,
            round(sum(ledger.score(gpu, most_free) for gpu in members), 6),
            tuple(-i for i in indices),
        )

    if math.comb(len(candidates), size) <= MAX_SET_CANDIDATES:
        options: list[tuple[Gpu, ...]] = list(itertools.combinations(candidates, size))
    else:
        options = [_grow(ledger, candidates, seed, size) for seed in candidates]
    best = max(options, key=key)
    return tuple(sorted(best, key=lambda gpu: gpu.index))


def _grow(ledger: Ledger, candidates: Sequence[Gpu], seed: Gpu, size: int) -> tuple[Gpu, ...]:
    """A set grown from `seed` by adding the GPU best connected to the members each time."""
    members = [seed]
    while len(members) < size:
        rest = [gpu for gpu in candidates if gpu not in members]
        members.append(
            max(
                rest,
                key=lambda gpu: (
                    min(ledger.topology.link(gpu.index, m.index).score for m in members),
                    -ledger.placed[gpu.index],
                    -gpu.index,
                ),
            )
        )
    return tuple(members)
