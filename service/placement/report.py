"""The text of `paddlequic topology`: the devices, the link matrix as `nvidia-smi topo -m` prints
it, the NUMA nodes, and where each instance would go and why."""

from __future__ import annotations

from collections.abc import Sequence

from service.placement.policy import Placement
from service.placement.selection import GIB
from service.placement.topology import Topology, format_cpulist

_LEGEND = (
    "  X    = self\n"
    "  NV#  = connected by # NVLinks (through NVSwitch where noted)\n"
    "  PIX  = at most one PCIe switch\n"
    "  PXB  = several PCIe switches, no host bridge\n"
    "  PHB  = a PCIe host bridge (the CPU)\n"
    "  NODE = host bridges within one NUMA node\n"
    "  SYS  = across NUMA nodes"
)


def describe(topology: Topology, placements: Sequence[Placement] = ()) -> str:
    sections = [_header(topology)]
    if topology.gpus:
        sections += [_devices(topology), _links(topology)]
    sections.append(_numa(topology))
    if placements:
        sections.append(_placements(placements))
    return "\n\n".join(sections) + "\n"


def _header(topology: Topology) -> str:
    if topology.simulated:
        line = f"Topology: simulated from {topology.source}"
    else:
        line = f"Topology: {topology.source or 'this host'}"
    if topology.description:
        line += f"\n  {topology.description}"
    gpus = f"{len(topology.gpus)} GPU(s)" if topology.gpus else "no GPUs"
    switch = ", NVSwitch" if topology.nvswitch else ""
    return f"{line}\n  {gpus}{switch}, {len(topology.numa_nodes)} NUMA node(s)"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _devices(topology: Topology) -> str:
    rows = [["GPU", "Name", "Memory free / total", "Util", "NUMA", "CPUs", "MIG", "Healthy"]]
    for gpu in topology.gpus:
        rows.append(
            [
                str(gpu.index),
                gpu.name,
                f"{gpu.memory_free_bytes / GIB:.1f} / {gpu.memory_total_bytes / GIB:.1f} GiB",
                "?" if gpu.utilization_percent is None else f"{gpu.utilization_percent}%",
                "?" if gpu.numa_node < 0 else str(gpu.numa_node),
                format_cpulist(gpu.cpu_affinity) or "?",
                {None: "?", True: "yes", False: "no"}[gpu.mig_enabled],
                "yes" if gpu.healthy else f"NO: {gpu.health_detail or 'unhealthy'}",
            ]
        )
    return "Devices\n" + _table(rows)


def _links(topology: Topology) -> str:
    names = [f"GPU{gpu.index}" for gpu in topology.gpus]
    rows = [["", *names, "CPU Affinity", "NUMA Affinity"]]
    for gpu, row in zip(topology.gpus, topology.links, strict=True):
        numa = "N/A" if gpu.numa_node < 0 else str(gpu.numa_node)
        cpus = format_cpulist(gpu.cpu_affinity) or "N/A"
        rows.append([f"GPU{gpu.index}", *(link.label for link in row), cpus, numa])
    return "Links\n" + _table(rows) + "\n\nLegend:\n" + _LEGEND


def _numa(topology: Topology) -> str:
    lines = [
        f"  node {node}: CPUs {format_cpulist(cpus)}" for node, cpus in topology.numa_nodes.items()
    ]
    return "NUMA nodes\n" + "\n".join(lines)


def _placements(placements: Sequence[Placement]) -> str:
    lines = ["Placement"]
    for p in placements:
        if p.device == "gpu":
            where = f"GPU {','.join(map(str, p.gpu_indices))} ({', '.join(p.gpu_uuids)})"
        else:
            where = "CPU"
        numa = f"NUMA {p.numa_node}" if p.numa_node >= 0 else "no single NUMA node"
        threads = p.env.get("OMP_NUM_THREADS", "?")
        cpus = format_cpulist(p.cpus)
        lines.append(
            f"  {p.instance_name} -> {where}, {numa}, CPUs {cpus}, OMP_NUM_THREADS={threads}"
        )
        lines.append(f"      why: {p.reason}")
    return "\n".join(lines)
