"""Placement on every recorded host: filters before scores, spreading, NVLink/PIX sets within a
NUMA node, anti-fragmentation, the worker environment and CPU sets, and the report."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from service.placement.policy import InstanceRequest, Placement, PlacementError, place
from service.placement.report import describe
from service.placement.topology import PcieLevel, Topology, load_topology_file, parse_cpulist

FIXTURES = Path(__file__).parent.parent / "fixtures" / "topology"
ALL_FIXTURES = sorted(path.stem for path in FIXTURES.glob("*.json"))
GIB = 1 << 30
ANY_CPU = frozenset(range(512))


def host(name: str) -> Topology:
    return load_topology_file(FIXTURES / f"{name}.json")


def with_gpus(topology: Topology, **changes: dict[str, Any]) -> Topology:
    """`topology` with GPU fields changed: with_gpus(t, gpu1={"memory_free_bytes": ...})."""
    gpus = list(topology.gpus)
    for key, fields in changes.items():
        index = int(key.removeprefix("gpu"))
        gpus[index] = replace(gpus[index], **fields)
    return replace(topology, gpus=tuple(gpus))


def gpu_request(count: int = 1, per_instance: int = 1, **options: Any) -> InstanceRequest:
    return InstanceRequest("m", "GPU", count, gpus_per_instance=per_instance, **options)


def sets(placements: list[Placement]) -> list[tuple[int, ...]]:
    return [p.gpu_indices for p in placements]


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_one_instance_per_gpu_spreads_over_all_usable_gpus(name: str) -> None:
    topology = host(name)
    estimate = 2 * GIB
    usable = [
        gpu.index
        for gpu in topology.gpus
        if gpu.healthy and not gpu.mig_enabled and gpu.memory_free_bytes >= estimate * 1.1
    ]
    request = gpu_request(len(usable), memory_estimate_bytes=estimate)
    placements = place([request], topology, allowed_cpus=ANY_CPU)
    assert sorted(index for p in placements for index in p.gpu_indices) == usable
    assert [p.instance_name for p in placements] == [f"m_gpu{n}" for n in range(len(usable))]


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_worker_environment_and_cpus_are_what_placement_decided(name: str) -> None:
    topology = host(name)
    allowed = frozenset(range(0, 512, 2))  # e.g. a cgroup that allows only even CPUs
    for p in place([gpu_request(len(topology.gpus))], topology, allowed_cpus=allowed):
        gpus = [topology.gpus[i] for i in p.gpu_indices]
        assert p.device == "gpu" and p.gpu_uuids == tuple(g.uuid for g in gpus)
        assert p.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert p.env["CUDA_VISIBLE_DEVICES"] == ",".join(g.uuid for g in gpus)
        assert p.cpus == gpus[0].cpu_affinity & allowed and p.numa_node == gpus[0].numa_node
        assert 1 <= int(p.env["OMP_NUM_THREADS"]) <= min(8, len(p.cpus))


def test_sets_avoid_filtered_gpus_even_if_that_breaks_nvlink_pairs() -> None:
    # GPU 1 is nearly full and GPU 3 is in MIG mode: filters come before scores, so the only
    # possible pair is {0, 2}, across sockets, though (0,1) and (2,3) are NVLink pairs.
    topology = host("a100_pcie_nvlink_pairs")
    request = gpu_request(per_instance=2, memory_estimate_bytes=4 * GIB)
    (placement,) = place([request], topology, allowed_cpus=ANY_CPU)
    assert placement.gpu_indices == (0, 2) and placement.numa_node == -1
    assert "GPU 1 filtered: 1.8 GiB free < 4.4 GiB needed" in placement.reason
    assert "GPU 3 filtered: MIG mode enabled" in placement.reason
    assert placement.cpus == parse_cpulist("0-127")  # both GPUs' NUMA CPUs


def test_sets_prefer_nvlink_pairs_when_they_pass_the_filters() -> None:
    topology = with_gpus(
        host("a100_pcie_nvlink_pairs"),
        gpu1={"memory_free_bytes": 40 * GIB},
        gpu3={"mig_enabled": False},
    )
    request = gpu_request(per_instance=2, memory_estimate_bytes=4 * GIB)
    (placement,) = place([request], topology, allowed_cpus=ANY_CPU)
    # both pairs are NV12; GPU 1 is 97% busy, so the idle pair wins
    assert placement.gpu_indices == (2, 3) and placement.numa_node == 1
    assert "worst link NV12" in placement.reason
    assert sets(place([replace(request, count=2)], topology, allowed_cpus=ANY_CPU)) == [
        (2, 3),
        (0, 1),
    ]


def test_mig_gpus_only_when_allowed() -> None:
    topology = host("a100_pcie_nvlink_pairs")
    with pytest.raises(PlacementError, match="GPU 3: MIG mode enabled"):
        place([gpu_request(gpus=(3,))], topology, allowed_cpus=ANY_CPU)
    (placement,) = place([gpu_request(gpus=(3,), allow_mig=True)], topology, allowed_cpus=ANY_CPU)
    assert placement.gpu_indices == (3,)


def test_dgx_sets_stay_within_one_numa_node() -> None:
    topology = host("dgx_h100")
    (placement,) = place([gpu_request(per_instance=4)], topology, allowed_cpus=ANY_CPU)
    assert placement.gpu_indices == (0, 1, 2, 3) and placement.numa_node == 0
    assert placement.cpus == parse_cpulist("0-47,96-143")
    (near,) = place([gpu_request(per_instance=4)], topology, frontend_numa=1, allowed_cpus=ANY_CPU)
    assert near.gpu_indices == (4, 5, 6, 7)
    two = place([gpu_request(2, per_instance=4)], topology, allowed_cpus=ANY_CPU)
    assert sets(two) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # pairs fill one node before the other, keeping a whole NUMA node free for a quad
    assert sets(place([gpu_request(4, per_instance=2)], topology, allowed_cpus=ANY_CPU)) == [
        (0, 1),
        (2, 3),
        (4, 5),
        (6, 7),
    ]


def test_pcie_switched_pairs_are_pix_and_disjoint() -> None:
    topology = host("pcie8_switched")
    placements = place([gpu_request(4, per_instance=2)], topology, allowed_cpus=ANY_CPU)
    pairs = sets(placements)
    for i, j in pairs:
        assert topology.link(i, j).pcie_level is PcieLevel.PIX
    assert sorted(index for pair in pairs for index in pair) == list(range(8))


def test_anti_fragmentation_takes_pairs_from_the_broken_quad() -> None:
    # One GPU is down. The three PIX pairs left are equally good for this instance, but the pair
    # from the broken quad keeps the other quad whole (for a later 4-GPU instance on one socket).
    pcie8 = host("pcie8_switched")
    for down, expected_pair, expected_triple in ((7, (4, 5), (4, 5, 6)), (0, (2, 3), (1, 2, 3))):
        topology = with_gpus(pcie8, **{f"gpu{down}": {"healthy": False}})
        (pair,) = place([gpu_request(per_instance=2)], topology, allowed_cpus=ANY_CPU)
        assert pair.gpu_indices == expected_pair
        assert f"GPU {down} filtered: unhealthy" in pair.reason
        (triple,) = place([gpu_request(per_instance=3)], topology, allowed_cpus=ANY_CPU)
        assert triple.gpu_indices == expected_triple


def test_pcie_without_switches_pairs_within_a_socket() -> None:
    topology = host("pcie4_noswitch")
    pairs = sets(place([gpu_request(2, per_instance=2)], topology, allowed_cpus=ANY_CPU))
    assert pairs == [(0, 1), (2, 3)]


def test_single_gpu_scores_free_memory_utilization_and_locality() -> None:
    topology = host("pcie4_noswitch")
    (local,) = place([gpu_request()], topology, frontend_numa=1, allowed_cpus=ANY_CPU)
    assert local.gpu_indices == (2,) and "NUMA 1 local" in local.reason
    busy = with_gpus(topology, gpu0={"utilization_percent": 90}, gpu1={"memory_free_bytes": GIB})
    (best,) = place([gpu_request()], busy, allowed_cpus=ANY_CPU)
    assert best.gpu_indices == (2,)
    # a busy, nearly full GPU gets no second-round instance while idle ones have room
    a100 = host("a100_pcie_nvlink_pairs")
    three = place([gpu_request(3)], a100, allowed_cpus=ANY_CPU)
    assert sets(three) == [(0,), (2,), (0,)]


def test_memory_placed_by_this_call_counts() -> None:
    topology = host("single_h200")  # 139.9 GiB free
    placements = place([gpu_request(2, memory_estimate_bytes=60 * GIB)], topology)
    assert sets(placements) == [(0,), (0,)]
    with pytest.raises(PlacementError, match=r"after 132\.0 GiB for instances placed before"):
        place([gpu_request(3, memory_estimate_bytes=60 * GIB)], topology)


def test_impossible_requests_say_why_for_every_gpu() -> None:
    topology = host("a100_pcie_nvlink_pairs")
    with pytest.raises(PlacementError) as error:
        place([gpu_request(per_instance=2, memory_estimate_bytes=39 * GIB)], topology)
    message = str(error.value)
    assert message.startswith("cannot place m instance 1 of 1 (needs 42.9 GiB per GPU)")
    for why in (
        "GPU 0: 39.1 GiB free < 42.9 GiB needed",
        "GPU 1: 1.8 GiB free < 42.9 GiB needed",
        "GPU 2: 38.1 GiB free < 42.9 GiB needed",
        "GPU 3: MIG mode enabled",
    ):
        assert why in message
    with pytest.raises(PlacementError, match=r"names GPU \[7\] but the host has 4 GPU"):
        place([gpu_request(gpus=(7,))], topology)
    with pytest.raises(PlacementError, match=r"only GPUs \[1\] are in the instance group"):
        place([gpu_request(gpus=(1,), memory_estimate_bytes=8 * GIB)], topology)
    with pytest.raises(PlacementError, match=r"1 usable GPU\(s\) for 2 per instance"):
        place([gpu_request(per_instance=2)], host("single_h200"))
    cpu_only = replace(topology, gpus=(), links=(), pcie=(), source="CPU-only host")
    with pytest.raises(PlacementError, match=r"no GPUs \(CPU-only host\)"):
        place([gpu_request()], cpu_only)


def test_explicit_gpus_are_respected() -> None:
    topology = host("dgx_h100")
    placements = place([gpu_request(3, gpus=(5, 6))], topology, allowed_cpus=ANY_CPU)
    assert sets(placements) == [(5,), (6,), (5,)]
    (pair,) = place([gpu_request(per_instance=2, gpus=(1, 7))], topology, allowed_cpus=ANY_CPU)
    assert pair.gpu_indices == (1, 7)


def two_node_host() -> Topology:
    nodes = {0: parse_cpulist("0-7"), 1: parse_cpulist("8-15")}
    return Topology((), (), (), False, nodes, source="fake two-node host")


def test_cpu_instances_spread_over_numa_nodes() -> None:
    placements = place([InstanceRequest("c", "CPU", 4)], two_node_host(), allowed_cpus=ANY_CPU)
    assert [p.numa_node for p in placements] == [0, 1, 0, 1]
    assert [p.cpus for p in placements] == [parse_cpulist("0-7"), parse_cpulist("8-15")] * 2
    for p in placements:
        assert p.device == "cpu" and p.gpu_indices == () and p.gpu_uuids == ()
        assert p.env == {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "4"}  # 8 CPUs, 2 each
    assert [p.instance_name for p in placements] == ["c_cpu0", "c_cpu1", "c_cpu2", "c_cpu3"]


def test_cpu_instances_use_allowed_cpus_and_the_front_end_node() -> None:
    topology = two_node_host()
    first = place([InstanceRequest("c", "CPU", 1)], topology, frontend_numa=1, allowed_cpus=ANY_CPU)
    assert first[0].numa_node == 1 and "local to the front-end" in first[0].reason
    allowed = parse_cpulist("2-5")
    placements = place([InstanceRequest("c", "CPU", 2)], topology, allowed_cpus=allowed)
    assert [(p.numa_node, p.cpus) for p in placements] == [(0, allowed), (0, allowed)]
    nowhere = place([InstanceRequest("c", "CPU", 1)], topology, allowed_cpus=frozenset({99}))
    assert nowhere[0].numa_node == -1 and nowhere[0].cpus == frozenset({99})


def test_gpu_cpus_fall_back_to_allowed_ones() -> None:
    topology = host("dgx_h100")
    allowed = parse_cpulist("0-3")
    (placement,) = place([gpu_request(gpus=(5,))], topology, allowed_cpus=allowed)
    assert placement.cpus == allowed and "are not allowed here" in placement.reason
    assert placement.env["OMP_NUM_THREADS"] == "4"


def test_requests_are_validated() -> None:
    with pytest.raises(ValueError, match="CPU or GPU"):
        InstanceRequest("m", "TPU", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        InstanceRequest("m", "GPU", 1, gpus_per_instance=0)
    with pytest.raises(ValueError, match="headroom"):
        place([], host("single_h200"), headroom=-0.5)


def test_report_describes_devices_links_and_placements() -> None:
    topology = host("a100_pcie_nvlink_pairs")
    requests = [
        InstanceRequest("resnet", "GPU", 2, memory_estimate_bytes=4 * GIB),
        InstanceRequest("tiny", "CPU", 1),
    ]
    text = describe(topology, place(requests, topology, allowed_cpus=ANY_CPU))
    assert f"simulated from {FIXTURES / 'a100_pcie_nvlink_pairs.json'}" in text
    assert "NVIDIA A100-PCIE-40GB  1.8 / 40.0 GiB" in text
    assert "GPU0  X     NV12  SYS   SYS   0-31,64-95" in text
    assert "resnet_gpu0 -> GPU 0 (GPU-a100-pcie-40gb-00" in text
    assert "GPU 1 filtered: 1.8 GiB free < 4.4 GiB needed" in text
    assert "tiny_cpu0 -> CPU, NUMA 0" in text
    dgx = describe(host("dgx_h100"))
    assert "8 GPU(s), NVSwitch, 2 NUMA node(s)" in dgx and "Placement" not in dgx
    cpu_only = describe(two_node_host())
    assert "no GPUs" in cpu_only and "Links" not in cpu_only and "node 1: CPUs 8-15" in cpu_only
