"""The topology model: recorded-host files, cpulists, CPU-only hosts from /sys, and NVML discovery
against a stand-in for the NVML library (this machine has no GPU and no driver)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.placement import nvml
from service.placement.topology import (
    Link,
    PcieLevel,
    TopologyError,
    cpu_only_topology,
    format_cpulist,
    load_topology_file,
    parse_cpulist,
    topology_from_dict,
    topology_to_dict,
)

# The real nvidia-ml-py module (untyped): its error classes and constants; no library is loaded.
pynvml: Any = importlib.import_module("pynvml")

FIXTURES = Path(__file__).parent.parent / "fixtures" / "topology"
ALL_FIXTURES = sorted(path.stem for path in FIXTURES.glob("*.json"))


def fixture(name: str) -> Path:
    return FIXTURES / f"{name}.json"


# --- recorded host files ------------------------------------------------------------------------


def test_all_five_fixtures_are_here() -> None:
    assert ALL_FIXTURES == [
        "a100_pcie_nvlink_pairs",
        "dgx_h100",
        "pcie4_noswitch",
        "pcie8_switched",
        "single_h200",
    ]


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_fixture_loads_consistently(name: str) -> None:
    topology = load_topology_file(fixture(name))
    raw = json.loads(fixture(name).read_text())
    count = len(raw["gpus"])
    assert topology.simulated and topology.source == str(fixture(name))
    assert [gpu.index for gpu in topology.gpus] == list(range(count))
    assert [gpu.uuid for gpu in topology.gpus] == [g["uuid"] for g in raw["gpus"]]
    for i in range(count):
        for j in range(count):
            link = topology.link(i, j)
            assert link == topology.link(j, i)
            assert link.label == raw["links"][i][j]
            assert link.pcie_level.name == raw["pcie"][i][j]
    # NUMA nodes come from the GPUs' CPU affinity when the file has none.
    for gpu in topology.gpus:
        assert gpu.cpu_affinity <= topology.numa_nodes[gpu.numa_node]
    assert topology_from_dict(topology_to_dict(topology), "again") == topology_from_dict(
        raw, "again"
    )


def test_fixture_details() -> None:
    dgx = load_topology_file(fixture("dgx_h100"))
    assert dgx.nvswitch and dgx.link(0, 7) == Link(18, PcieLevel.SYS)
    assert dgx.link(0, 3) == Link(18, PcieLevel.NODE)
    assert dgx.numa_nodes[1] == parse_cpulist("48-95,144-191")
    a100 = load_topology_file(fixture("a100_pcie_nvlink_pairs"))
    assert a100.link(0, 1) == Link(12, PcieLevel.NODE) and a100.link(1, 2) == Link(0, PcieLevel.SYS)
    assert a100.gpus[3].mig_enabled is True and a100.gpus[1].utilization_percent == 97
    assert a100.gpus[1].memory_free_bytes == 1887436800
    t4 = load_topology_file(fixture("pcie8_switched"))
    assert [t4.link(0, j).label for j in range(8)] == ["X", "PIX", "PXB", "PXB"] + ["SYS"] * 4
    h200 = load_topology_file(fixture("single_h200"))
    assert len(h200.gpus) == 1 and h200.link(0, 0).label == "X" and not h200.nvswitch


def test_link_ranking() -> None:
    order = ["NV18", "NV12", "NV1", "PIX", "PXB", "PHB", "NODE", "SYS"]
    scores = [Link.parse(text, PcieLevel.SYS).score for text in order]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == len(scores)
    assert Link.parse("NV18", PcieLevel.NODE).score > Link.parse("NV18", PcieLevel.SYS).score
    assert Link.parse("X").score > Link.parse("NV18").score
    assert PcieLevel.PIX < PcieLevel.PXB < PcieLevel.PHB < PcieLevel.NODE < PcieLevel.SYS
    for bad in ("NV0", "NVX", "pix", ""):
        with pytest.raises(ValueError, match="unknown link"):
            Link.parse(bad)


def _broken(mutate: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(fixture("a100_pcie_nvlink_pairs").read_text())
    mutate(data)
    return data


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("gpus"), r"gpus: expected a list, got nothing"),
        (lambda d: d["gpus"][1].pop("uuid"), r"gpus\[1\]: missing uuid"),
        (lambda d: d["gpus"][2].update(index=5), r"gpus\[2\]\.index: is 5"),
        (
            lambda d: d["gpus"][0].update(memory_free_bytes="lots"),
            r"gpus\[0\]\.memory_free_bytes: expected an integer",
        ),
        (
            lambda d: d["gpus"][0].update(memory_free_bytes=1 << 40),
            r"gpus\[0\]\.memory_free_bytes: \d+ exceeds memory_total_bytes",
        ),
        (
            lambda d: d["gpus"][3].update(utilization_gpu_percent=130),
            r"utilization_gpu_percent: 130 is over 100",
        ),
        (lambda d: d["gpus"][1].update(cpu_affinity="0-x"), r"gpus\[1\]\.cpu_affinity: bad"),
        (lambda d: d["gpus"][1].update(healthy="yes"), r"gpus\[1\]\.healthy: expected true"),
        (lambda d: d["gpus"][1].update(uuid=d["gpus"][0]["uuid"]), r"uuids must be unique"),
        (lambda d: d["links"].pop(), r"links: has 3 rows for 4 GPUs"),
        (lambda d: d["links"][0].__setitem__(1, "NV7"), r"links\[1\]\[0\]: differs from links"),
        (lambda d: d["links"][2].__setitem__(3, "FAST"), r"links\[2\]\[3\]: unknown link 'FAST'"),
        (lambda d: d["links"][2].__setitem__(3, 12), r"links\[2\]\[3\]: expected a string"),
        (lambda d: d["pcie"][0].__setitem__(1, "NV12"), r"pcie\[0\]\[1\]: unknown PCIe level"),
        (lambda d: d["links"][0].__setitem__(0, "SYS"), r"links\[0\]\[0\]: SYS but pcie\[0\]\[0\]"),
        (
            lambda d: [d["links"][0].__setitem__(2, "PIX"), d["links"][2].__setitem__(0, "PIX")],
            r"links\[0\]\[2\]: PIX but pcie\[0\]\[2\] is SYS",
        ),
        (lambda d: d.update(nvswitch="no"), r"nvswitch: expected true or false"),
        (lambda d: d.update(numa_nodes={"zero": "0-3"}), r"numa_nodes: node 'zero'"),
    ],
)
def test_malformed_files_name_file_and_field(
    tmp_path: Path, mutate: Callable[[dict[str, Any]], object], message: str
) -> None:
    path = tmp_path / "host.json"
    path.write_text(json.dumps(_broken(mutate)))
    with pytest.raises(TopologyError, match=message) as error:
        load_topology_file(path)
    assert str(error.value).startswith(f"{path}: ")


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"missing\.json: cannot read topology file"):
        load_topology_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TopologyError, match=r"bad\.json: not valid JSON"):
        load_topology_file(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(TopologyError, match=r"list\.json: the top level: expected an object"):
        load_topology_file(tmp_path / "list.json")


def test_explicit_numa_nodes_in_file() -> None:
    data = _broken(lambda d: d.update(numa_nodes={"1": "32-63", "0": "0-31"}))
    topology = topology_from_dict(data, "inline")
    assert topology.numa_nodes == {0: frozenset(range(32)), 1: frozenset(range(32, 64))}
    assert list(topology.numa_nodes) == [0, 1]


# --- cpulists -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-31,64-95", set(range(32)) | set(range(64, 96))),
        ("0", {0}),
        ("0,2,4-5\n", {0, 2, 4, 5}),
        (" 3 , 1 ", {1, 3}),
        ("", set()),
        ("\n", set()),
    ],
)
def test_parse_cpulist(text: str, cpus: set[int]) -> None:
    assert parse_cpulist(text) == frozenset(cpus)


@pytest.mark.parametrize("text", ["a", "1-", "-3", "5-2", "1;2", "0-3:2"])
def test_parse_cpulist_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="cpulist"):
        parse_cpulist(text)


def test_format_cpulist() -> None:
    assert format_cpulist(set(range(32)) | set(range(64, 96))) == "0-31,64-95"
    assert format_cpulist([5, 0, 1, 2, 7, 9, 10]) == "0-2,5,7,9-10"
    assert format_cpulist([]) == "" and format_cpulist({0}) == "0"


@given(st.frozensets(st.integers(min_value=0, max_value=300)))
def test_cpulist_round_trip(cpus: frozenset[int]) -> None:
    assert parse_cpulist(format_cpulist(cpus)) == cpus


# --- CPU-only hosts -----------------------------------------------------------------------------


def make_sys_root(root: Path, nodes: dict[int, str], pci_numa: dict[str, int] | None = None) -> str:
    for node, cpulist in nodes.items():
        directory = root / "devices" / "system" / "node" / f"node{node}"
        directory.mkdir(parents=True)
        (directory / "cpulist").write_text(cpulist + "\n")
    (root / "devices" / "system" / "node" / "possible").parent.mkdir(parents=True, exist_ok=True)
    (root / "devices" / "system" / "node" / "possible").write_text("0-3\n")
    for bus_id, node in (pci_numa or {}).items():
        directory = root / "bus" / "pci" / "devices" / bus_id
        directory.mkdir(parents=True)
        (directory / "numa_node").write_text(f"{node}\n")
    return str(root)


def test_cpu_only_topology_reads_numa_nodes(tmp_path: Path) -> None:
    # node 2 is memory only (CXL, HBM): no CPUs, so no place for a worker.
    root = make_sys_root(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15", 2: ""})
    topology = cpu_only_topology(root)
    assert topology.gpus == () and topology.links == () and not topology.nvswitch
    assert topology.numa_nodes == {0: parse_cpulist("0-3,8-11"), 1: parse_cpulist("4-7,12-15")}
    assert not topology.simulated and "CPU-only" in topology.source


def test_cpu_only_topology_without_numa_information(tmp_path: Path) -> None:
    topology = cpu_only_topology(str(tmp_path))
    assert topology.numa_nodes == {0: frozenset(os.sched_getaffinity(0))}


# --- NVML discovery -----------------------------------------------------------------------------

SWITCH_BUS = "00000000:C5:00.0"


@dataclass
class FakeDevice:
    uuid: str
    bus_id: str
    affinity_words: list[int] = field(default_factory=lambda: [0xFF])
    total: int = 80 << 30
    free: int = 79 << 30
    util: int = 5
    numa: int | None = None  # nvmlDeviceGetNumaNodeId; None: NotSupported
    mig: int = 0
    nvlinks: dict[int, str] = field(default_factory=dict)  # active link -> remote bus id
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)
    fail: dict[str, int] = field(default_factory=dict)  # function -> NVML error code


class FakeNvml:
    """A stand-in for the NVML library (pynvml's functions over recorded devices), raising the
    real nvidia-ml-py error classes the way the library does."""

    NVMLError = pynvml.NVMLError
    NVML_NVLINK_MAX_LINKS = 18

    def __init__(
        self,
        devices: list[FakeDevice],
        ancestors: dict[tuple[int, int], int] | None = None,
        init_error: int | None = None,
        fail: dict[str, int] | None = None,
    ) -> None:
        self.devices = devices
        self.ancestors = ancestors or {}
        self.init_error = init_error
        self.fail = fail or {}
        self.calls: list[str] = []

    def _enter(self, function: str, handle: int | None = None) -> FakeDevice | None:
        self.calls.append(function)
        device = None if handle is None else self.devices[handle]
        code = self.fail.get(function) or (device.fail.get(function) if device else None)
        if code:
            raise pynvml.NVMLError(code)
        return device

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return "570.86.15"

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._enter("nvmlDeviceGetHandleByIndex", index)
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._device("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        self._device("nvmlDeviceGetName", handle)
        return b"NVIDIA H100 80GB HBM3"  # older nvidia-ml-py versions return bytes

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self._device("nvmlDeviceGetPciInfo", handle).bus_id)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        device = self._device("nvmlDeviceGetMemoryInfo", handle)
        return SimpleNamespace(
            total=device.total, free=device.free, used=device.total - device.free
        )

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._device("nvmlDeviceGetUtilizationRates", handle).util)

    def nvmlDeviceGetCpuAffinity(self, handle: int, size: int) -> list[int]:
        words = self._device("nvmlDeviceGetCpuAffinity", handle).affinity_words
        assert size >= 1
        return (words + [0] * size)[:size]

    def nvmlDeviceGetNumaNodeId(self, handle: int) -> int:
        device = self._device("nvmlDeviceGetNumaNodeId", handle)
        if device.numa is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return device.numa

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        device = self._device("nvmlDeviceGetMigMode", handle)
        return [device.mig, device.mig]

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        return self._device("nvmlDeviceGetRemappedRows", handle).remapped

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        self._device("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        return 0

    def nvmlDeviceGetTopologyCommonAncestor(self, first: int, second: int) -> int:
        self._enter("nvmlDeviceGetTopologyCommonAncestor", first)
        return self.ancestors.get((first, second), int(pynvml.NVML_TOPOLOGY_SYSTEM))

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        device = self._device("nvmlDeviceGetNvLinkState", handle)
        if link >= self.NVML_NVLINK_MAX_LINKS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(link in device.nvlinks)

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: int, link: int) -> SimpleNamespace:
        device = self._device("nvmlDeviceGetNvLinkRemotePciInfo", handle)
        return SimpleNamespace(busId=device.nvlinks[link])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: int, link: int) -> int:
        device = self._device("nvmlDeviceGetNvLinkRemoteDeviceType", handle)
        if device.nvlinks[link] == SWITCH_BUS:
            return int(pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)
        return int(pynvml.NVML_NVLINK_DEVICE_TYPE_GPU)

    def _device(self, function: str, handle: int) -> FakeDevice:
        device = self._enter(function, handle)
        assert device is not None
        return device


NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


def test_two_gpus_with_an_nvlink_bridge(tmp_path: Path) -> None:
    root = make_sys_root(tmp_path, {0: "0-7", 1: "8-15"}, {"0000:17:00.0": 0, "0000:b1:00.0": 1})
    devices = [
        FakeDevice(
            "GPU-a",
            "00000000:17:00.0",
            [0x00FF],
            nvlinks=dict.fromkeys(range(4), "00000000:B1:00.0"),
        ),
        FakeDevice(
            "GPU-b",
            "00000000:B1:00.0",
            [0xFF00],
            nvlinks=dict.fromkeys(range(4), "00000000:17:00.0"),
            util=40,
        ),
    ]
    fake = FakeNvml(devices, {(0, 1): pynvml.NVML_TOPOLOGY_SYSTEM})
    topology = nvml.discover(fake, root)
    assert fake.calls[0] == "nvmlInit" and fake.calls[-1] == "nvmlShutdown"
    assert not topology.simulated and topology.source == "NVML (driver 570.86.15)"
    first, second = topology.gpus
    assert (first.uuid, first.name, first.pci_bus_id) == (
        "GPU-a",
        "NVIDIA H100 80GB HBM3",
        "00000000:17:00.0",
    )
    assert (first.memory_total_bytes, first.memory_free_bytes) == (80 << 30, 79 << 30)
    assert first.cpu_affinity == frozenset(range(8)) and second.cpu_affinity == frozenset(
        range(8, 16)
    )
    assert (first.numa_node, second.numa_node) == (0, 1)  # from /sys/bus/pci/devices
    assert second.utilization_percent == 40 and first.mig_enabled is False and first.healthy
    assert topology.link(0, 1) == topology.link(1, 0) == Link(4, PcieLevel.SYS)
    assert topology.link(0, 0).label == "X" and not topology.nvswitch
    assert topology.numa_nodes == {0: frozenset(range(8)), 1: frozenset(range(8, 16))}


def test_nvswitch_host_counts_links_per_device(tmp_path: Path) -> None:
    root = make_sys_root(tmp_path, {0: "0-7", 1: "8-15"})
    bus_ids = ["00000000:18:00.0", "00000000:2A:00.0", "00000000:9A:00.0", "00000000:AB:00.0"]
    # GPU 3 has 6 of its 18 links down: NV12 to everyone, NV18 between the others.
    links = [18, 18, 18, 12]
    devices = [
        FakeDevice(f"GPU-{i}", bus, numa=i // 2, nvlinks=dict.fromkeys(range(links[i]), SWITCH_BUS))
        for i, bus in enumerate(bus_ids)
    ]
    ancestors = {(0, 1): pynvml.NVML_TOPOLOGY_NODE, (2, 3): pynvml.NVML_TOPOLOGY_NODE}
    topology = nvml.discover(FakeNvml(devices, ancestors), root)
    assert topology.nvswitch
    labels = [[link.label for link in row] for row in topology.links]
    assert labels == [
        ["X", "NV18", "NV18", "NV12"],
        ["NV18", "X", "NV18", "NV12"],
        ["NV18", "NV18", "X", "NV12"],
        ["NV12", "NV12", "NV12", "X"],
    ]
    assert topology.pcie[0][1] is PcieLevel.NODE and topology.pcie[1][2] is PcieLevel.SYS
    assert [gpu.numa_node for gpu in topology.gpus] == [0, 0, 1, 1]  # NVML's NUMA id (no /sys)


def test_unsupported_fields_become_unknown(tmp_path: Path) -> None:
    unsupported = [
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetCpuAffinity",
        "nvmlDeviceGetNumaNodeId",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlDeviceGetTopologyCommonAncestor",
        "nvmlDeviceGetNvLinkState",
        "nvmlSystemGetDriverVersion",
    ]
    devices = [
        FakeDevice("GPU-t4-0", "00000000:1A:00.0"),
        FakeDevice("GPU-t4-1", "00000000:1B:00.0"),
    ]
    fake = FakeNvml(devices, fail=dict.fromkeys(unsupported, NOT_SUPPORTED))
    topology = nvml.discover(fake, str(tmp_path))  # no /sys information either
    for gpu in topology.gpus:
        assert gpu.utilization_percent is None and gpu.numa_node == -1
        assert gpu.cpu_affinity == frozenset()
        assert gpu.mig_enabled is False  # NotSupported: the GPU cannot do MIG
        assert gpu.healthy, gpu.health_detail
    assert topology.link(0, 1) == Link(0, PcieLevel.SYS)  # unknown path: assume the worst
    assert topology.source == "NVML (driver unknown)"
    # NvLinkState NotSupported on link 0: the other links of that GPU are not asked about.
    assert fake.calls.count("nvmlDeviceGetNvLinkState") == 2
    assert fake.calls[-1] == "nvmlShutdown"


def test_other_per_field_errors_and_missing_functions(tmp_path: Path) -> None:
    class OldNvml(FakeNvml):
        # an nvidia-ml-py without these functions
        nvmlDeviceGetNumaNodeId = None  # type: ignore[assignment]
        nvmlDeviceGetNvLinkRemoteDeviceType = None  # type: ignore[assignment]

    root = make_sys_root(tmp_path, {0: "0-7", 1: "8-15"})
    devices = [
        FakeDevice(
            "GPU-0",
            "00000000:18:00.0",
            [0xFF00],
            fail={"nvmlDeviceGetMigMode": pynvml.NVML_ERROR_NO_PERMISSION},
        ),
        FakeDevice("GPU-1", "00000000:2A:00.0", nvlinks={0: SWITCH_BUS, 1: SWITCH_BUS}),
    ]
    topology = nvml.discover(OldNvml(devices), root)
    assert topology.gpus[0].mig_enabled is None  # unknown
    assert topology.gpus[0].numa_node == 1  # from its CPU affinity 8-15
    assert topology.gpus[1].numa_node == 0
    # GPU 1 reaches something that is not one of our GPUs: a switch, but GPU 0 has no links.
    assert topology.nvswitch and topology.link(0, 1).nvlinks == 0


def test_nvml_numa_id_of_a_cpu_less_node_is_not_used(tmp_path: Path) -> None:
    # Grace Hopper: NVML names the GPU's own memory node (no CPUs), not the CPUs near it.
    root = make_sys_root(tmp_path, {0: "0-71", 1: "", 4: ""})
    devices = [FakeDevice("GPU-gh200", "00000009:01:00.0", [(1 << 64) - 1, 0xFF], numa=4)]
    topology = nvml.discover(FakeNvml(devices), root)
    assert topology.gpus[0].numa_node == 0 and topology.numa_nodes == {0: frozenset(range(72))}


def test_unhealthy_gpus(tmp_path: Path) -> None:
    devices = [
        FakeDevice(
            "GPU-0",
            "00000000:18:00.0",
            fail={"nvmlDeviceGetMemoryInfo": pynvml.NVML_ERROR_GPU_IS_LOST},
        ),
        FakeDevice("GPU-1", "00000000:2A:00.0", remapped=(0, 2, 1, 0)),
        FakeDevice("GPU-2", "00000000:3A:00.0", remapped=(0, 2, 0, 1)),
        FakeDevice("GPU-3", "00000000:5D:00.0"),
    ]
    topology = nvml.discover(FakeNvml(devices), str(tmp_path))
    health = [(gpu.healthy, gpu.health_detail) for gpu in topology.gpus]
    assert not health[0][0] and "GPU is lost" in health[0][1]
    assert health[1] == (False, "row remapping pending (reset required)")
    assert health[2] == (False, "row remapping failed")
    assert health[3] == (True, "")


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED]
)
def test_no_driver_means_cpu_only(tmp_path: Path, code: int) -> None:
    root = make_sys_root(tmp_path, {0: "0-3", 1: "4-7"})
    fake = FakeNvml([FakeDevice("GPU-0", "00000000:18:00.0")], init_error=code)
    topology = nvml.discover(fake, root)
    assert topology.gpus == () and topology.numa_nodes == {
        0: frozenset(range(4)),
        1: frozenset(range(4, 8)),
    }
    assert "CPU-only" in topology.source and str(pynvml.NVMLError(code)) in topology.source
    assert fake.calls == ["nvmlInit"]  # nothing else, no shutdown of what never started


def test_other_init_failures_also_mean_cpu_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNvml([], init_error=pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
    topology = nvml.discover(fake, str(tmp_path))
    assert topology.gpus == () and "NVML failed to initialize" in caplog.text


def test_count_failure_still_shuts_nvml_down(tmp_path: Path) -> None:
    fake = FakeNvml([], fail={"nvmlDeviceGetCount": pynvml.NVML_ERROR_UNKNOWN})
    assert nvml.discover(fake, str(tmp_path)).gpus == ()
    assert fake.calls[-1] == "nvmlShutdown"


def test_real_nvml_without_a_driver_is_cpu_only() -> None:
    # This machine has no NVIDIA driver: the real library reports LibraryNotFound. On a GPU host
    # this discovers the real GPUs instead; either way it must not raise.
    topology = nvml.discover()
    assert topology.numa_nodes
    if not topology.gpus:
        assert "CPU-only" in topology.source


def test_bus_ids_and_masks() -> None:
    assert nvml.sysfs_bus_id("00000000:B1:00.0") == "0000:b1:00.0"
    assert nvml.sysfs_bus_id("00000009:01:00.0") == "0009:01:00.0"
    assert nvml.sysfs_bus_id("0000:3b:00.0") == "0000:3b:00.0"
    assert nvml.sysfs_bus_id("garbage") == ""
    assert nvml.cpus_from_mask([0b101, 1]) == frozenset({0, 2, 64})
    assert nvml.cpus_from_mask([]) == frozenset()


def test_importing_scheduling_loads_neither_nvml_nor_paddle() -> None:
    code = (
        "import sys, service.placement.nvml, service.placement.policy, "
        "service.placement.report; print(sorted({'pynvml', 'paddle'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
