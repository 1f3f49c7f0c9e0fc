"""Placement: model instance requests -> devices, CPU sets and worker environment.

GPU instances: filter (instance group's GPUs, healthy, not MIG unless allowed, free memory >=
estimate * (1 + headroom), counting what this call already placed), then score
(`service.placement.selection`). CPU instances: spread over NUMA nodes by load per CPU.
Each worker is pinned to the CPUs near its device that the process may use, and its thread count
is those CPUs divided among the instances this call put on the same NUMA node, capped.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

from service.placement.selection import Ledger, best_gpu, best_set, gib
from service.placement.topology import Gpu, Topology, format_cpulist

GPU_WORKER_MAX_THREADS = 8  # a GPU worker's CPU threads only feed the GPU
CPU_WORKER_MAX_THREADS = 32  # beyond this, one predictor gains little per request


class PlacementError(Exception):
    """A request that no device can take; the message says why for every GPU."""


@dataclass(frozen=True)
class InstanceRequest:
    """One instance_group of a model. `count` is the number of instances in all;
    `memory_estimate_bytes` is what each instance needs on each of its GPUs."""

    model: str
    kind: Literal["CPU", "GPU"]
    count: int = 1
    gpus: tuple[int, ...] = ()  # the instance group's GPU indices; empty: any
    gpus_per_instance: int = 1
    memory_estimate_bytes: int = 0
    allow_mig: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("CPU", "GPU"):
            raise ValueError(f"{self.model}: instance kind must be CPU or GPU, not {self.kind!r}")
        if self.count < 0 or self.gpus_per_instance < 1 or self.memory_estimate_bytes < 0:
            raise ValueError(f"{self.model}: count, GPUs per instance and memory must be positive")


@dataclass(frozen=True)
class Placement:
    instance_name: str
    model: str
    device: Literal["cpu", "gpu"]
    gpu_indices: tuple[int, ...]
    gpu_uuids: tuple[str, ...]
    numa_node: int  # -1: none or several
    cpus: frozenset[int]
    env: dict[str, str]
    reason: str


def place(
    requests: Iterable[InstanceRequest],
    topology: Topology,
    frontend_numa: int | None = None,
    headroom: float = 0.1,
    allowed_cpus: frozenset[int] | None = None,
) -> list[Placement]:
    """Where every instance of every request goes, in request order; PlacementError if one
    cannot be placed. `allowed_cpus` defaults to this process's CPU affinity."""
    if headroom < 0:
        raise ValueError("headroom must not be negative")
    allowed = frozenset(os.sched_getaffinity(0)) if allowed_cpus is None else allowed_cpus
    ledger = Ledger(topology, frontend_numa)
    cpu_load: Counter[int] = Counter()
    placements: list[Placement] = []
    names: Counter[tuple[str, str]] = Counter()
    for request in requests:
        for number in range(request.count):
            if request.kind == "GPU":
                placement = _place_gpu(request, number, ledger, headroom, allowed)
            else:
                placement = _place_cpu(request, topology, frontend_numa, cpu_load, allowed)
            name_key = (request.model, placement.device)
            name = f"{request.model}_{placement.device}{names[name_key]}"
            names[name_key] += 1
            placements.append(replace(placement, instance_name=name))
    return _with_threads(placements)


def _place_gpu(
    request: InstanceRequest, number: int, ledger: Ledger, headroom: float, allowed: frozenset[int]
) -> Placement:
    topology, size = ledger.topology, request.gpus_per_instance
    need = math.ceil(request.memory_estimate_bytes * (1 + headroom))
    what = f"{request.model} instance {number + 1} of {request.count}"
    unknown = sorted(set(request.gpus) - {gpu.index for gpu in topology.gpus})
    if unknown:
        raise PlacementError(
            f"cannot place {what}: the instance group names GPU {unknown} but the host has "
            f"{len(topology.gpus)} GPU(s)"
        )
    if not topology.gpus:
        raise PlacementError(f"cannot place {what} on a GPU: no GPUs ({topology.source})")
    filtered: dict[int, str] = {}
    candidates: list[Gpu] = []
    for gpu in topology.gpus:
        if request.gpus and gpu.index not in request.gpus:
            continue
        problem = ledger.why_not(gpu, need, request.allow_mig)
        if problem:
            filtered[gpu.index] = problem
        else:
            candidates.append(gpu)
    if len(candidates) < size:
        reasons = [f"GPU {index}: {why}" for index, why in filtered.items()]
        if request.gpus:
            reasons.append(f"only GPUs {list(request.gpus)} are in the instance group")
        usable = f"{len(candidates)} usable GPU(s) for {size} per instance"
        raise PlacementError(
            f"cannot place {what} (needs {gib(need)} per GPU): {usable}; {'; '.join(reasons)}"
        )
    chosen = (best_gpu(ledger, candidates),) if size == 1 else best_set(ledger, candidates, size)
    reason = _gpu_reason(ledger, chosen, filtered)
    ledger.take([gpu.index for gpu in chosen], need)
    nodes = {gpu.numa_node for gpu in chosen}
    numa_node = nodes.pop() if len(nodes) == 1 else -1
    near = frozenset[int]().union(*(gpu.cpu_affinity for gpu in chosen))
    cpus, note = _usable_cpus(near or topology.numa_nodes.get(numa_node, frozenset()), allowed)
    uuids = tuple(gpu.uuid for gpu in chosen)
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(uuids)}
    return Placement(
        "",
        request.model,
        "gpu",
        tuple(g.index for g in chosen),
        uuids,
        numa_node,
        cpus,
        env,
        reason + note,
    )


def _gpu_reason(ledger: Ledger, chosen: tuple[Gpu, ...], filtered: dict[int, str]) -> str:
    parts = [ledger.describe(gpu) for gpu in chosen]
    if len(chosen) > 1:
        pairs = [(a.index, b.index) for n, a in enumerate(chosen) for b in chosen[n + 1 :]]
        worst = min((ledger.topology.link(i, j) for i, j in pairs), key=lambda link: link.score)
        members = ",".join(str(gpu.index) for gpu in chosen)
        parts.insert(0, f"GPUs {members}, worst link {worst.label}")
    parts.extend(f"GPU {index} filtered: {why}" for index, why in filtered.items())
    return "; ".join(parts)


def _place_cpu(
    request: InstanceRequest,
    topology: Topology,
    frontend_numa: int | None,
    load: Counter[int],
    allowed: frozenset[int],
) -> Placement:
    env = {"CUDA_VISIBLE_DEVICES": ""}  # a CPU instance must not touch a GPU
    nodes = {n: cpus & allowed for n, cpus in topology.numa_nodes.items() if cpus & allowed}
    if not nodes:
        reason = "no NUMA node has allowed CPUs; all allowed CPUs"
        return Placement("", request.model, "cpu", (), (), -1, allowed, env, reason)
    node = min(nodes, key=lambda n: ((load[n] + 1) / len(nodes[n]), n != frontend_numa, n))
    before = load[node]
    load[node] += 1
    reason = f"NUMA node {node} (CPUs {format_cpulist(nodes[node])})"
    if frontend_numa is not None:
        reason += ", local to the front-end" if node == frontend_numa else ", remote"
    if before:
        reason += f", {before} other CPU instance(s) there"
    return Placement("", request.model, "cpu", (), (), node, nodes[node], env, reason)


def _usable_cpus(near: frozenset[int], allowed: frozenset[int]) -> tuple[frozenset[int], str]:
    """The device's near CPUs that we may use; all allowed ones if none (with a note)."""
    usable = near & allowed
    if usable:
        return usable, ""
    if near:
        return allowed, f" (its CPUs {format_cpulist(near)} are not allowed here; all allowed CPUs)"
    return allowed, " (CPU affinity unknown; all allowed CPUs)"


def _with_threads(placements: list[Placement]) -> list[Placement]:
    """OMP_NUM_THREADS: the instance's CPUs shared among the instances placed on the same NUMA
    node (or with the same CPUs when the node is unknown), at least 1, capped by kind."""
    sharing = Counter(_cpu_group(p) for p in placements)
    result = []
    for p in placements:
        cap = GPU_WORKER_MAX_THREADS if p.device == "gpu" else CPU_WORKER_MAX_THREADS
        threads = max(1, min(cap, len(p.cpus) // sharing[_cpu_group(p)]))
        result.append(replace(p, env={**p.env, "OMP_NUM_THREADS": str(threads)}))
    return result


def _cpu_group(placement: Placement) -> int | frozenset[int]:
    return placement.numa_node if placement.numa_node >= 0 else placement.cpus
