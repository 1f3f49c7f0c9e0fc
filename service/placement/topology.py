"""The host as the scheduler sees it: GPUs, the link between every pair, the CPUs of each NUMA
node. Built by NVML discovery (`service.placement.nvml`), loaded from a recorded file
(`load_topology_file`, the format of tests/fixtures/topology) or made for a CPU-only host."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from service.placement.cpulist import format_cpulist, parse_cpulist

__all__ = [
    "Gpu",
    "Link",
    "PcieLevel",
    "Topology",
    "TopologyError",
    "cpu_only_topology",
    "format_cpulist",
    "load_topology_file",
    "parse_cpulist",
    "read_numa_nodes",
    "topology_from_dict",
    "topology_to_dict",
]


class TopologyError(ValueError):
    """A topology that cannot be used: a malformed file, inconsistent matrices."""


class PcieLevel(IntEnum):
    """Closest common PCIe ancestor of two devices, nearest first (`nvidia-smi topo -m` names)."""

    X = 0  # the device itself
    PIX = 1  # at most one PCIe switch between them
    PXB = 2  # several PCIe switches, no host bridge
    PHB = 3  # a PCIe host bridge (the CPU's root complex)
    NODE = 4  # host bridges within one NUMA node
    SYS = 5  # across NUMA nodes (the socket interconnect); also assumed when unknown


@dataclass(frozen=True)
class Link:
    """How two GPUs reach each other: active NVLinks (direct or through NVSwitch) and the PCIe
    path."""

    nvlinks: int = 0
    pcie_level: PcieLevel = PcieLevel.SYS

    @classmethod
    def parse(cls, text: str, pcie: PcieLevel | None = None) -> Link:
        """`X`, `NV<n>` (PCIe level from `pcie`, SYS if not given) or a PCIe level name."""
        match = re.fullmatch(r"NV(\d+)", text)
        if match and int(match[1]) > 0:
            return cls(int(match[1]), PcieLevel.SYS if pcie is None else pcie)
        if text in PcieLevel.__members__:
            return cls(0, PcieLevel[text])
        raise ValueError(f"unknown link {text!r} (expected X, NV<n>, PIX, PXB, PHB, NODE or SYS)")

    @property
    def label(self) -> str:
        if self.pcie_level is PcieLevel.X:
            return "X"
        return f"NV{self.nvlinks}" if self.nvlinks else self.pcie_level.name

    @property
    def score(self) -> int:
        """Higher is better: any NVLink beats any PCIe path, more NVLinks beat fewer, and the
        PCIe level breaks ties (NV18 within a NUMA node beats NV18 across)."""
        if self.pcie_level is PcieLevel.X:
            return 1_000_000
        return self.nvlinks * 10 + (PcieLevel.SYS + 1 - self.pcie_level)


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_bytes: int
    memory_free_bytes: int
    utilization_percent: int | None  # None: unknown
    numa_node: int  # CPU-side NUMA node of the GPU's PCIe root; -1: unknown
    cpu_affinity: frozenset[int]  # NUMA-local CPUs; empty: unknown
    mig_enabled: bool | None  # None: unknown
    healthy: bool
    health_detail: str = ""  # why it is not healthy


@dataclass(frozen=True)
class Topology:
    gpus: tuple[Gpu, ...]
    links: tuple[tuple[Link, ...], ...]
    pcie: tuple[tuple[PcieLevel, ...], ...]
    nvswitch: bool
    numa_nodes: dict[int, frozenset[int]]  # NUMA node -> its CPUs (nodes without CPUs left out)
    simulated: bool = False  # loaded from a file, not discovered
    source: str = ""  # where it came from, for people
    description: str = ""

    def __post_init__(self) -> None:
        count = len(self.gpus)
        for position, gpu in enumerate(self.gpus):
            if gpu.index != position:
                raise TopologyError(f"GPU at position {position} has index {gpu.index}")
        for name, matrix in (("links", self.links), ("pcie", self.pcie)):
            if len(matrix) != count or any(len(row) != count for row in matrix):
                raise TopologyError(f"{name} must be a {count}x{count} matrix")

    def link(self, first: int, second: int) -> Link:
        return self.links[first][second]


def topology_from_dict(data: Any, origin: str, *, simulated: bool = True) -> Topology:
    """Build a topology from the recorded-host format; errors name `origin` and the field."""
    check = _Checker(origin)
    top = check.mapping(data, "the top level")
    gpu_list = check.sequence(top.get("gpus"), "gpus")
    gpus = tuple(_gpu_from_dict(check, item, position) for position, item in enumerate(gpu_list))
    uuids = [gpu.uuid for gpu in gpus]
    if len(set(uuids)) != len(uuids):
        raise check.error("gpus", "uuids must be unique")
    count = len(gpus)
    pcie = _matrix(check, top.get("pcie"), "pcie", count, _parse_pcie)
    links = _matrix(check, top.get("links"), "links", count, Link.parse)
    for i in range(count):
        for j in range(count):
            where = f"links[{i}][{j}]"
            if links[i][j].nvlinks and i == j:
                raise check.error(where, "a GPU has no link to itself; expected X")
            if links[i][j].nvlinks:
                links[i][j] = Link(links[i][j].nvlinks, pcie[i][j])
            elif links[i][j].pcie_level != pcie[i][j]:
                raise check.error(
                    where, f"{links[i][j].label} but pcie[{i}][{j}] is {pcie[i][j].name}"
                )
            if (pcie[i][j] is PcieLevel.X) != (i == j):
                raise check.error(where, "X belongs on the diagonal and only there")
    nvswitch = top.get("nvswitch", False)
    if not isinstance(nvswitch, bool):
        raise check.error("nvswitch", "expected true or false")
    numa_nodes = _numa_nodes_from_dict(check, top.get("numa_nodes"), gpus)
    description = top.get("description", "")
    return Topology(
        gpus=gpus,
        links=tuple(tuple(row) for row in links),
        pcie=tuple(tuple(row) for row in pcie),
        nvswitch=nvswitch,
        numa_nodes=numa_nodes,
        simulated=simulated,
        source=origin,
        description=description if isinstance(description, str) else "",
    )


def load_topology_file(path: str | os.PathLike[str]) -> Topology:
    """A recorded host (`--topology FILE`); TopologyError names the file and the bad field."""
    file = Path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TopologyError(f"{file}: cannot read topology file: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TopologyError(f"{file}: not valid JSON: {exc}") from exc
    return topology_from_dict(data, str(file), simulated=True)


def topology_to_dict(topology: Topology) -> dict[str, Any]:
    """The recorded-host format, so a discovered host can be saved and replayed as a file."""
    return {
        "description": topology.description or topology.source,
        "nvswitch": topology.nvswitch,
        "gpus": [
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "name": gpu.name,
                "pci_bus_id": gpu.pci_bus_id,
                "memory_total_bytes": gpu.memory_total_bytes,
                "memory_free_bytes": gpu.memory_free_bytes,
                "utilization_gpu_percent": gpu.utilization_percent,
                "numa_node": gpu.numa_node,
                "cpu_affinity": format_cpulist(gpu.cpu_affinity),
                "mig_enabled": gpu.mig_enabled,
                "healthy": gpu.healthy,
            }
            for gpu in topology.gpus
        ],
        "links": [[link.label for link in row] for row in topology.links],
        "pcie": [[level.name for level in row] for row in topology.pcie],
        "numa_nodes": {
            str(node): format_cpulist(cpus) for node, cpus in topology.numa_nodes.items()
        },
    }


def read_numa_nodes(sys_root: str = "/sys") -> dict[int, frozenset[int]]:
    """NUMA node -> CPUs from <sys_root>/devices/system/node/node*/cpulist; CPU-less (memory
    only) nodes are left out; {} when the directory is absent."""
    nodes: dict[int, frozenset[int]] = {}
    for entry in Path(sys_root, "devices", "system", "node").glob("node*"):
        match = re.fullmatch(r"node(\d+)", entry.name)
        if not match:
            continue
        try:
            cpus = parse_cpulist((entry / "cpulist").read_text(encoding="ascii"))
        except (OSError, ValueError):
            continue
        if cpus:
            nodes[int(match[1])] = cpus
    return dict(sorted(nodes.items()))


def cpu_only_topology(sys_root: str = "/sys") -> Topology:
    """A host without GPUs: its NUMA nodes from /sys, else one node of the CPUs we may use."""
    nodes = read_numa_nodes(sys_root)
    source = f"CPU-only host; NUMA nodes from {Path(sys_root, 'devices/system/node')}"
    if not nodes:
        nodes = {0: frozenset(os.sched_getaffinity(0))}
        source = "CPU-only host; no NUMA information, one node of the allowed CPUs"
    return Topology((), (), (), False, nodes, simulated=False, source=source)


class _Checker:
    def __init__(self, origin: str) -> None:
        self.origin = origin

    def error(self, field: str, problem: str) -> TopologyError:
        return TopologyError(f"{self.origin}: {field}: {problem}")

    def mapping(self, value: Any, field: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.error(field, f"expected an object, got {_kind(value)}")
        return value

    def sequence(self, value: Any, field: str) -> Sequence[Any]:
        if not isinstance(value, list):
            raise self.error(field, f"expected a list, got {_kind(value)}")
        return value

    def integer(self, value: Any, field: str, minimum: int, *, nullable: bool = False) -> Any:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(field, f"expected an integer >= {minimum}, got {value!r}")
        return value

    def text(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(field, f"expected a non-empty string, got {value!r}")
        return value

    def cpus(self, value: Any, field: str) -> frozenset[int]:
        if not isinstance(value, str):
            raise self.error(
                field, f"expected a cpulist string such as '0-31,64-95', got {value!r}"
            )
        try:
            return parse_cpulist(value)
        except ValueError as exc:
            raise self.error(field, str(exc)) from None


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


_REQUIRED_GPU_FIELDS = (
    "index",
    "uuid",
    "name",
    "pci_bus_id",
    "memory_total_bytes",
    "memory_free_bytes",
    "numa_node",
    "cpu_affinity",
    "healthy",
)


def _parse_pcie(text: str) -> PcieLevel:
    if text not in PcieLevel.__members__:
        raise ValueError(f"unknown PCIe level {text!r} (expected X, PIX, PXB, PHB, NODE or SYS)")
    return PcieLevel[text]


def _gpu_from_dict(check: _Checker, item: Any, position: int) -> Gpu:
    where = f"gpus[{position}]"
    gpu = check.mapping(item, where)
    missing = [key for key in _REQUIRED_GPU_FIELDS if key not in gpu]
    if missing:
        raise check.error(where, f"missing {', '.join(missing)}")
    index = check.integer(gpu["index"], f"{where}.index", 0)
    if index != position:
        raise check.error(f"{where}.index", f"is {index}; GPUs must be listed by index from 0")
    total = check.integer(gpu["memory_total_bytes"], f"{where}.memory_total_bytes", 0)
    free = check.integer(gpu["memory_free_bytes"], f"{where}.memory_free_bytes", 0)
    if free > total:
        raise check.error(f"{where}.memory_free_bytes", f"{free} exceeds memory_total_bytes")
    util = check.integer(
        gpu.get("utilization_gpu_percent"), f"{where}.utilization_gpu_percent", 0, nullable=True
    )
    if util is not None and util > 100:
        raise check.error(f"{where}.utilization_gpu_percent", f"{util} is over 100")
    mig, healthy = gpu.get("mig_enabled"), gpu["healthy"]
    if mig is not None and not isinstance(mig, bool):
        raise check.error(f"{where}.mig_enabled", f"expected true, false or null, got {mig!r}")
    if not isinstance(healthy, bool):
        raise check.error(f"{where}.healthy", f"expected true or false, got {healthy!r}")
    return Gpu(
        index=index,
        uuid=check.text(gpu["uuid"], f"{where}.uuid"),
        name=check.text(gpu["name"], f"{where}.name"),
        pci_bus_id=check.text(gpu["pci_bus_id"], f"{where}.pci_bus_id"),
        memory_total_bytes=total,
        memory_free_bytes=free,
        utilization_percent=util,
        numa_node=check.integer(gpu["numa_node"], f"{where}.numa_node", -1),
        cpu_affinity=check.cpus(gpu["cpu_affinity"], f"{where}.cpu_affinity"),
        mig_enabled=mig,
        healthy=healthy,
        health_detail="" if healthy else "marked unhealthy in the topology file",
    )


def _matrix(
    check: _Checker, value: Any, name: str, count: int, parse: Callable[[str], Any]
) -> list[list[Any]]:
    rows = check.sequence(value, name)
    if len(rows) != count:
        raise check.error(name, f"has {len(rows)} rows for {count} GPUs")
    matrix: list[list[Any]] = []
    for i, row in enumerate(check.sequence(r, f"{name}[{n}]") for n, r in enumerate(rows)):
        if len(row) != count:
            raise check.error(f"{name}[{i}]", f"has {len(row)} entries for {count} GPUs")
        parsed = []
        for j, text in enumerate(row):
            try:
                if not isinstance(text, str):
                    raise ValueError(f"expected a string such as 'SYS', got {text!r}")
                parsed.append(parse(text))
            except ValueError as exc:
                raise check.error(f"{name}[{i}][{j}]", str(exc)) from None
        matrix.append(parsed)
    for i in range(count):
        for j in range(i):
            if matrix[i][j] != matrix[j][i]:
                raise check.error(f"{name}[{i}][{j}]", f"differs from {name}[{j}][{i}]")
    return matrix


def _numa_nodes_from_dict(
    check: _Checker, value: Any, gpus: Sequence[Gpu]
) -> dict[int, frozenset[int]]:
    """The file's `numa_nodes` ({"0": "0-31,64-95"}) if given, else each GPU NUMA node with the
    union of its GPUs' CPU affinity."""
    nodes: dict[int, frozenset[int]] = {}
    if value is not None:
        for key, cpus in check.mapping(value, "numa_nodes").items():
            if not str(key).isdigit():
                raise check.error("numa_nodes", f"node {key!r} is not a number")
            nodes[int(key)] = check.cpus(cpus, f"numa_nodes.{key}")
        return dict(sorted(nodes.items()))
    for gpu in gpus:
        if gpu.numa_node >= 0 and gpu.cpu_affinity:
            nodes[gpu.numa_node] = nodes.get(gpu.numa_node, frozenset()) | gpu.cpu_affinity
    return dict(sorted(nodes.items()))
