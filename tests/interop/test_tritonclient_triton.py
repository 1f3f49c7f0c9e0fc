"""Triton's example clients' steps and the texts they compare, with tritonclient itself
(tritonclient_triton_check.py, in its own process), against a server started as they expect
one: `--server-name triton`, explicit model control with `simple` and `upper` loaded and `mlp`
in the repository but not loaded."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import EXAMPLE_MODELS, REPO_ROOT, running_server

SCRIPT = Path(__file__).with_name("tritonclient_triton_check.py")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CHECK_TIMEOUT_S = 300


def install(repository: Path, name: str, fixture: Path) -> None:
    (repository / name / "1").mkdir(parents=True)
    shutil.copy(fixture / "config.pbtxt", repository / name / "config.pbtxt")
    shutil.copy(fixture / "model.py", repository / name / "1" / "model.py")


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("triton-names")
    repository = root / "models"
    install(repository, "simple", FIXTURES / "simple")
    install(repository, "upper", FIXTURES / "python_model")
    (repository / "mlp").symlink_to(EXAMPLE_MODELS / "mlp")
    args = ["--no-h3", "--server-name", "triton", "--model-control-mode", "explicit"]
    args += ["--load-model", "simple,upper"]
    with running_server(repository, root / "server.log", args) as server:
        out = root / "summary.json"
        command = [sys.executable, str(SCRIPT), "--url", server.address, "--out", str(out)]
        finished = subprocess.run(
            command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
        )
        assert finished.returncode == 0, finished.stderr
        yield json.loads(out.read_text())


def test_server_metadata_name_is_configurable_and_extensions_true(
    summary: dict[str, Any],
) -> None:
    metadata = summary["server_metadata"]
    assert metadata["name"] == "triton"  # simple_grpc_health_metadata.py compares it
    assert set(metadata["extensions"]) == {
        "classification",
        "sequence",
        "model_repository",
        "schedule_policy",
        "model_configuration",
        "system_shared_memory",
        "binary_tensor_data",
        "parameters",
        "statistics",
    }


def test_error_texts_start_as_tritons(summary: dict[str, Any]) -> None:
    """The texts Triton's example clients look for in the errors they provoke."""
    texts = summary["texts"]
    assert texts["typed_sums"] == [i + 1 for i in range(16)]
    assert texts["unknown_model"].startswith(
        "Request for unknown model: 'wrong_model_name' is not found"
    )
    assert texts["bad_version"].startswith(
        "failed to get model version from specified version string 'wrong_specification'"
    )
    assert texts["contents_beside_raw"].startswith(
        "contents field must not be specified when using raw_input_contents for 'INPUT0' "
        "for model 'simple'"
    )
    assert texts["load_unknown"].startswith(
        "failed to load 'wrong_model_name', failed to poll from model repository"
    )


def test_repository_index_lists_every_model_in_explicit_mode(summary: dict[str, Any]) -> None:
    """Loaded models with their versions and state; `mlp`, never loaded, with its name only
    (as Triton lists it)."""
    listed = {(m["name"], m.get("version", ""), m.get("state", "")) for m in summary["index"]}
    assert listed == {("simple", "1", "READY"), ("upper", "1", "READY"), ("mlp", "", "")}


def test_cuda_shared_memory_answers_as_triton_without_a_gpu(summary: dict[str, Any]) -> None:
    cuda = summary["cuda"]
    assert cuda["unregister"] is None
    assert cuda["status"] == {} and cuda["status_after"] == {}
    assert cuda["register"].startswith(
        "failed to register CUDA shared memory region: 'gpu_region', GPUs not supported"
    )


def test_bytes_tensors_travel_in_system_shared_memory(summary: dict[str, Any]) -> None:
    """A BYTES input read from the caller's region, a BYTES and an INT32 output written into
    theirs, each element a 4-byte little-endian length and its bytes, as tritonclient writes
    and reads them."""
    served = summary["bytes_shm"]
    assert served["upper"] == ["PADDLE", "QUIC", "", "H\u00c9"]
    assert served["length"] == [6, 4, 0, 2]
    assert served["raw_lengths"] == [0, 0]  # both outputs travelled in shared memory only
    assert served["left"] == {}
