"""Topology-aware placement end to end: a recorded multi-GPU host, GPU instances simulated by
CPU predictors, and worker processes started with the environment and CPU affinity placement
decided."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from service.placement.cpulist import parse_cpulist
from service.placement.topology import load_topology_file
from tests.reference import example_inputs, output_names, run_reference
from tests.servers import EXAMPLE_MODELS, REPO_ROOT, running_server

FIXTURE = REPO_ROOT / "tests/fixtures/topology/a100_pcie_nvlink_pairs.json"


def gpu_repository(root: Path) -> Path:
    model = root / "models" / "mlp"
    model.mkdir(parents=True)
    (model / "1").symlink_to(EXAMPLE_MODELS / "mlp" / "1")
    config = (EXAMPLE_MODELS / "mlp" / "config.pbtxt").read_text()
    config = config.replace("{ kind: KIND_CPU, count: 1 }", "{ kind: KIND_GPU, count: 2 }")
    (model / "config.pbtxt").write_text(config)
    return root / "models"


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def allowed_cpus(pid: int) -> frozenset[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpulist(line.split(":", 1)[1].strip())
    raise AssertionError("no Cpus_allowed_list")


def test_gpu_instances_go_where_placement_says(tmp_path: Path) -> None:
    topology = load_topology_file(FIXTURE)
    args = ["--topology", str(FIXTURE), "--no-h3"]
    with running_server(gpu_repository(tmp_path), tmp_path / "server.log", args) as server:
        instances = sorted(server.instances("mlp"), key=lambda i: i.name)
        # GPU 1 is nearly full and GPU 3 is in MIG mode: the filters leave 0 and 2.
        assert [i.device for i in instances] == [
            "gpu 0 (simulated: CPU predictor)",
            "gpu 2 (simulated: CPU predictor)",
        ]
        for instance, gpu in zip(instances, (0, 2), strict=True):
            env = environ(instance.pid)
            assert env["CUDA_VISIBLE_DEVICES"] == topology.gpus[gpu].uuid
            assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            wanted = topology.gpus[gpu].cpu_affinity & os.sched_getaffinity(0)
            assert allowed_cpus(instance.pid) == (wanted or frozenset(os.sched_getaffinity(0)))
        assert "SIMULATED" in server.log_text()
        inputs = example_inputs("mlp")
        served = parse_response(server.stub.ModelInfer(build_request("mlp", inputs), timeout=30))
        output = output_names("mlp")[0]
        np.testing.assert_allclose(served[output], run_reference("mlp", inputs)[output], rtol=1e-5)


@pytest.mark.parametrize("fixture", ["dgx_h100.json", "pcie8_switched.json"])
def test_topology_command_explains_placement(fixture: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "clients.cli",
        "topology",
        "--topology",
        str(REPO_ROOT / "tests/fixtures/topology" / fixture),
        "--model-repository",
        str(gpu_repository(tmp_path)),
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "simulated from" in result.stdout
    assert "mlp_1_gpu0 -> GPU" in result.stdout and "mlp_1_gpu1 -> GPU" in result.stdout
    assert "why:" in result.stdout
