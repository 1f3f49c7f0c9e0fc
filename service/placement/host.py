"""The topology the server schedules on: a recorded host or the real one."""

from __future__ import annotations

import logging

from service.placement.nvml import discover
from service.placement.topology import Topology, load_topology_file

log = logging.getLogger("paddlequic.server")


def load_topology(path: str) -> Topology:
    """A recorded host from --topology, or what NVML finds here (CPU-only without a driver)."""
    topology = load_topology_file(path) if path else discover()
    if topology.gpus:
        log.info(
            "topology: %d GPU(s)%s (%s)",
            len(topology.gpus),
            ", SIMULATED: GPU instances run CPU predictors" if topology.simulated else "",
            topology.source,
        )
    else:
        log.info("topology: %s, %d NUMA node(s)", topology.source, len(topology.numa_nodes))
    return topology
