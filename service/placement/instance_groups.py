"""From a model's instance_group to placed worker specs: the bridge between the model
configuration and the placement policy.

Triton's meaning of `count` is kept where the config names GPUs (`count` instances on each
listed GPU). Where it names none, `count` is the total and placement chooses the GPUs, since
choosing them by topology is what the scheduler is for. KIND_AUTO means GPU when the host has a
usable one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from protos.inference import model_config_pb2 as mc
from service.placement.cpulist import CPU_AFFINITY_ENV
from service.placement.policy import InstanceRequest, Placement, PlacementError, place
from service.placement.topology import Topology, format_cpulist

DEFAULT_GPU_MEMORY_MB = 1024


def instance_requests(
    key: str, config: mc.ModelConfig, topology: Topology
) -> list[InstanceRequest]:
    """`key` names the model version ("mlp_1"); instance names derive from it."""
    params = {k: v.string_value for k, v in config.parameters.items()}
    memory = int(params.get("gpu_memory_mb", DEFAULT_GPU_MEMORY_MB)) << 20
    per_instance = int(params.get("gpus_per_instance", "1"))
    groups = list(config.instance_group) or [
        mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_AUTO)
    ]
    requests = []
    for group in groups:
        kind = group.kind
        if kind == mc.ModelInstanceGroup.KIND_AUTO:
            usable = any(g.healthy and not g.mig_enabled for g in topology.gpus)
            kind = mc.ModelInstanceGroup.KIND_GPU if usable else mc.ModelInstanceGroup.KIND_CPU
        count = max(group.count, 1)
        if kind == mc.ModelInstanceGroup.KIND_GPU:
            gpus = tuple(group.gpus)
            requests.append(
                InstanceRequest(
                    key,
                    "GPU",
                    count * len(gpus) if gpus else count,
                    gpus,
                    per_instance,
                    memory,
                )
            )
        else:
            requests.append(InstanceRequest(key, "CPU", count))
    return requests


def place_all(
    requests: dict[str, list[InstanceRequest]], topology: Topology
) -> tuple[dict[str, list[Placement]], dict[str, str]]:
    """Placements by model-version key, and the reason for each key that could not be placed.
    Everything is placed in one pass (so instances spread over all models); when that fails,
    each model is placed alone so only the one that does not fit fails."""
    frontend = frontend_numa_node(topology)
    try:
        flat = place([r for rs in requests.values() for r in rs], topology, frontend)
        return _by_key(flat, requests), {}
    except PlacementError:
        pass
    placed: dict[str, list[Placement]] = {}
    failed: dict[str, str] = {}
    for key, own in requests.items():
        try:
            placed[key] = place(own, topology, frontend)
        except PlacementError as exc:
            failed[key] = str(exc)
    return placed, failed


def _by_key(
    flat: Sequence[Placement], requests: dict[str, list[InstanceRequest]]
) -> dict[str, list[Placement]]:
    grouped: dict[str, list[Placement]] = {key: [] for key in requests}
    for placement in flat:
        grouped[placement.model].append(placement)
    return grouped


def frontend_numa_node(topology: Topology) -> int | None:
    """The NUMA node holding most of the CPUs this process may run on."""
    mine = os.sched_getaffinity(0)
    overlap = {node: len(cpus & mine) for node, cpus in topology.numa_nodes.items()}
    best = max(overlap, key=lambda n: (overlap[n], -n), default=None)
    return best if best is not None and overlap[best] else None


def worker_environment(
    placement: Placement, parameters: dict[str, str], cpu_predictor: bool
) -> dict[str, str]:
    env = {**placement.env, CPU_AFFINITY_ENV: format_cpulist(placement.cpus)}
    if cpu_predictor:
        # A CPU predictor's threads are the model's cpu_math_threads (Paddle warns otherwise).
        env["OMP_NUM_THREADS"] = parameters.get("cpu_math_threads", "1")
    return env
