"""Discovery of the real host through NVML (`nvidia-ml-py`, imported as `pynvml`).

Every query degrades on its own: a field NVML cannot give (NotSupported, no permission, an old
driver without the function) becomes unknown (None, -1, an empty CPU set) and discovery goes on.
Without NVML (no driver: NVMLError_LibraryNotFound / DriverNotLoaded) the host is CPU-only.

Health, kept simple: a GPU is unhealthy when NVML reports it lost or needing a reset on any query,
its memory cannot be read, a row remapping failed or is pending, or (GPUs without row remapping)
retired pages are pending. All of these mean "reset the GPU before trusting it".

NUMA node: the kernel's view of the GPU's PCI device (/sys/bus/pci/devices/<bus id>/numa_node),
the CPU-side node that placement wants; nvmlDeviceGetNumaNodeId is only a fallback, and only when
it names a node with CPUs, because NVML documents it for platforms where the GPU itself is a NUMA
node (its memory node on Grace Hopper, not the CPUs near it).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from service.placement.topology import (
    Gpu,
    Link,
    PcieLevel,
    Topology,
    cpu_only_topology,
    read_numa_nodes,
)

log = logging.getLogger("paddlequic.scheduling")

# NVML's numeric ABI (nvml.h), stable across driver versions.
_NOT_SUPPORTED = 3
_NO_NVML = {9, 12}  # DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND
_DEVICE_GONE = {15, 16, 28}  # GPU_IS_LOST, RESET_REQUIRED, GPU_NOT_FOUND
_TOPOLOGY_LEVELS = {
    0: PcieLevel.PIX,  # INTERNAL: two GPUs on one board
    10: PcieLevel.PIX,  # SINGLE
    20: PcieLevel.PXB,  # MULTIPLE
    30: PcieLevel.PHB,  # HOSTBRIDGE
    40: PcieLevel.NODE,  # NODE
    50: PcieLevel.SYS,  # SYSTEM
}
_MIG_ENABLED = 1
_NVLINK_REMOTE_SWITCH = 2
_DEFAULT_MAX_NVLINKS = 18


def discover(nvml: Any = None, sys_root: str = "/sys") -> Topology:
    """The host's GPUs and links through NVML, or a CPU-only topology when there is no driver.

    `nvml` is the pynvml module (imported here by default; nvidia-ml-py is a dependency of the
    server, so its absence is an incomplete install, not a CPU-only host); tests pass a
    stand-in for the library. `sys_root` is where /sys is (NUMA nodes, PCI devices)."""
    if nvml is None:
        nvml = importlib.import_module("pynvml")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        if _code(exc) in _NO_NVML:
            log.info("no NVIDIA driver (%s); CPU-only host", exc)
        else:
            log.warning("NVML failed to initialize (%s); treating this host as CPU-only", exc)
        return _cpu_only(sys_root, f"NVML: {exc}")
    try:
        return _read_host(nvml, sys_root)
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            log.debug("nvmlShutdown: %s", exc)


def sysfs_bus_id(bus_id: str) -> str:
    """NVML's "00000000:B1:00.0" -> the kernel's "0000:b1:00.0"; "" when unparseable."""
    match = re.fullmatch(
        r"(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])", bus_id
    )
    if not match:
        return ""
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"


def cpus_from_mask(words: Any) -> frozenset[int]:
    """nvmlDeviceGetCpuAffinity's array of 64-bit words (CPU 0 = bit 0 of word 0) -> CPUs."""
    return frozenset(
        word_index * 64 + bit
        for word_index, word in enumerate(words)
        for bit in range(64)
        if int(word) >> bit & 1
    )


class _Calls:
    """NVML calls that return None instead of raising, remembering why they failed."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.codes: dict[str, int | None] = {}
        self.gone: list[str] = []

    def __call__(self, function: str, *args: Any) -> Any:
        call = getattr(self.nvml, function, None)
        if call is None:  # older nvidia-ml-py without this function
            self.codes[function] = None
            return None
        try:
            return call(*args)
        except self.nvml.NVMLError as exc:
            code = _code(exc)
            self.codes[function] = code
            if code in _DEVICE_GONE:
                self.gone.append(f"{function}: {exc}")
            log.debug("%s%r: %s", function, args[1:], exc)
            return None

    def unsupported(self, function: str) -> bool:
        return self.codes.get(function) == _NOT_SUPPORTED


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return "" if value is None else str(value)


def _cpu_only(sys_root: str, why: str) -> Topology:
    topology = cpu_only_topology(sys_root)
    return replace(topology, source=f"{topology.source} ({why})")


def _read_host(nvml: Any, sys_root: str) -> Topology:
    calls = _Calls(nvml)
    count = calls("nvmlDeviceGetCount")
    if not isinstance(count, int):
        log.warning("NVML cannot count devices; treating this host as CPU-only")
        return _cpu_only(sys_root, "NVML could not count GPUs")
    numa_nodes = read_numa_nodes(sys_root)
    handles = [calls("nvmlDeviceGetHandleByIndex", index) for index in range(count)]
    gpus = [
        _read_gpu(nvml, index, handle, sys_root, numa_nodes) for index, handle in enumerate(handles)
    ]
    pcie = [[_pcie_level(calls, handles, i, j) for j in range(count)] for i in range(count)]
    nvlinks, nvswitch = _nvlink_counts(nvml, handles, gpus)
    links = tuple(
        tuple(Link(nvlinks[i][j] if i != j else 0, pcie[i][j]) for j in range(count))
        for i in range(count)
    )
    if not numa_nodes:
        for gpu in gpus:
            if gpu.numa_node >= 0 and gpu.cpu_affinity:
                numa_nodes[gpu.numa_node] = (
                    numa_nodes.get(gpu.numa_node, frozenset()) | gpu.cpu_affinity
                )
    if not numa_nodes:
        numa_nodes = {0: frozenset(os.sched_getaffinity(0))}
    driver = _text(calls("nvmlSystemGetDriverVersion"))
    return Topology(
        gpus=tuple(gpus),
        links=links,
        pcie=tuple(tuple(row) for row in pcie),
        nvswitch=nvswitch,
        numa_nodes=dict(sorted(numa_nodes.items())),
        simulated=False,
        source=f"NVML (driver {driver or 'unknown'})",
    )


def _read_gpu(
    nvml: Any, index: int, handle: Any, sys_root: str, numa_nodes: dict[int, frozenset[int]]
) -> Gpu:
    calls = _Calls(nvml)
    if handle is None:
        return Gpu(index, "", "unknown", "", 0, 0, None, -1, frozenset(), None, False, "no handle")
    pci = calls("nvmlDeviceGetPciInfo", handle)
    bus_id = _text(getattr(pci, "busId", ""))
    uuid = _text(calls("nvmlDeviceGetUUID", handle))
    name = _text(calls("nvmlDeviceGetName", handle)) or "unknown"
    memory = calls("nvmlDeviceGetMemoryInfo", handle)
    utilization = calls("nvmlDeviceGetUtilizationRates", handle)
    words = (max(os.cpu_count() or 1, *os.sched_getaffinity(0)) + 64) // 64
    mask = calls("nvmlDeviceGetCpuAffinity", handle, words)
    affinity = cpus_from_mask(mask) if mask is not None else frozenset()
    numa_node = _numa_node(calls, handle, bus_id, sys_root, numa_nodes, affinity)
    mig = calls("nvmlDeviceGetMigMode", handle)
    if mig is not None:
        mig_enabled: bool | None = int(mig[0]) == _MIG_ENABLED
    else:  # a GPU that does not support MIG is certainly not in MIG mode
        mig_enabled = False if calls.unsupported("nvmlDeviceGetMigMode") else None
    problems = _health_problems(calls, handle, memory, uuid)
    return Gpu(
        index=index,
        uuid=uuid,
        name=name,
        pci_bus_id=bus_id,
        memory_total_bytes=int(memory.total) if memory is not None else 0,
        memory_free_bytes=int(memory.free) if memory is not None else 0,
        utilization_percent=int(utilization.gpu) if utilization is not None else None,
        numa_node=numa_node,
        cpu_affinity=affinity,
        mig_enabled=mig_enabled,
        healthy=not problems,
        health_detail="; ".join(problems),
    )


def _health_problems(calls: _Calls, handle: Any, memory: Any, uuid: str) -> list[str]:
    problems = []
    if memory is None:
        problems.append("memory information unavailable")
    if not uuid:
        problems.append("no UUID to address it by")
    rows = calls("nvmlDeviceGetRemappedRows", handle)
    if rows is not None:
        _corrected, _uncorrected, pending, failed = rows
        if failed:
            problems.append("row remapping failed")
        elif pending:
            problems.append("row remapping pending (reset required)")
    elif calls("nvmlDeviceGetRetiredPagesPendingStatus", handle):
        problems.append("retired pages pending (reset required)")
    return calls.gone + problems


def _numa_node(
    calls: _Calls,
    handle: Any,
    bus_id: str,
    sys_root: str,
    numa_nodes: dict[int, frozenset[int]],
    affinity: frozenset[int],
) -> int:
    sysfs = sysfs_bus_id(bus_id)
    if sysfs:
        try:
            node = int(Path(sys_root, "bus", "pci", "devices", sysfs, "numa_node").read_text())
        except (OSError, ValueError):
            node = -1
        if node >= 0:
            return node
    node = calls("nvmlDeviceGetNumaNodeId", handle)
    if isinstance(node, int) and node >= 0 and (node in numa_nodes or not numa_nodes):
        return node
    overlaps = {n: len(cpus & affinity) for n, cpus in numa_nodes.items() if cpus & affinity}
    return max(overlaps, key=lambda n: overlaps[n]) if overlaps else -1


def _pcie_level(calls: _Calls, handles: list[Any], i: int, j: int) -> PcieLevel:
    if i == j:
        return PcieLevel.X
    first, second = handles[min(i, j)], handles[max(i, j)]
    if first is None or second is None:
        return PcieLevel.SYS
    level = calls("nvmlDeviceGetTopologyCommonAncestor", first, second)
    return _TOPOLOGY_LEVELS.get(level, PcieLevel.SYS) if isinstance(level, int) else PcieLevel.SYS


def _nvlink_counts(nvml: Any, handles: list[Any], gpus: list[Gpu]) -> tuple[list[list[int]], bool]:
    """Active NVLinks between every pair. A link whose remote end is another GPU counts for that
    pair; on NVSwitch hosts the remote end is a switch, so each GPU's switch links are counted and
    a pair of switch-connected GPUs gets NV<min(links_i, links_j)>."""
    count = len(handles)
    max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", _DEFAULT_MAX_NVLINKS))
    by_bus = {sysfs_bus_id(g.pci_bus_id): g.index for g in gpus if sysfs_bus_id(g.pci_bus_id)}
    direct = [[0] * count for _ in range(count)]
    to_switch = [0] * count
    for i, handle in enumerate(handles):
        if handle is None:
            continue
        calls = _Calls(nvml)
        for link in range(max_links):
            active = calls("nvmlDeviceGetNvLinkState", handle, link)
            if active is None and link == 0 and calls.unsupported("nvmlDeviceGetNvLinkState"):
                break  # no NVLink on this GPU
            if not active:
                continue
            remote = calls("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
            remote_bus = sysfs_bus_id(_text(getattr(remote, "busId", "")))
            if not remote_bus:
                continue
            peer = by_bus.get(remote_bus)
            if peer is not None and peer != i:
                direct[i][peer] += 1
                continue
            kind = calls("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
            if kind is None or kind == _NVLINK_REMOTE_SWITCH:
                to_switch[i] += 1  # not one of our GPUs: a switch (or a GPU we cannot see)
    counts = [
        [
            max(direct[i][j], direct[j][i])
            + (min(to_switch[i], to_switch[j]) if to_switch[i] and to_switch[j] else 0)
            for j in range(count)
        ]
        for i in range(count)
    ]
    return counts, any(to_switch)
