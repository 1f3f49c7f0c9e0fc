"""Triton's example clients against a server started as they expect one (`--server-name
triton`, explicit model control), each example's steps and checks made with tritonclient's API
in a process of its own (triton_examples_check.py), over REST and gRPC. The models are
tests/fixtures' stand-ins for Triton's sample models, with their names, tensors and behaviour.
Triton's own scripts are not part of this project: docs/triton-compatibility.md lists which of
them run unmodified."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import HTTP_PORT, REPO_ROOT, ServerProcess, running_server

SCRIPT = Path(__file__).with_name("triton_examples_check.py")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODELS = ("simple", "simple_int8", "simple_string", "simple_identity", "simple_sequence")
CHECK_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, int]]:
    root = tmp_path_factory.mktemp("triton-examples")
    repository = root / "models"
    for name in MODELS:
        (repository / name / "1").mkdir(parents=True)
        shutil.copy(FIXTURES / name / "config.pbtxt", repository / name / "config.pbtxt")
        shutil.copy(FIXTURES / name / "model.py", repository / name / "1" / "model.py")
    args = ["--no-h3", "--server-name", "triton", "--model-control-mode", "explicit"]
    args += ["--load-model", ",".join(MODELS), "--http-port", HTTP_PORT]
    with running_server(repository, root / "server.log", args) as s:
        yield s, s.http_port


def run(server: tuple[ServerProcess, int], example: str, protocol: str, *extra: str) -> None:
    grpc, http_port = server
    url = grpc.address if protocol == "grpc" else f"127.0.0.1:{http_port}"
    command = [sys.executable, str(SCRIPT), "--example", example, "--protocol", protocol]
    command += ["--url", url, *extra]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"PASS: {example} over {protocol}" in done.stdout


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("example", ["shm", "shm_string", "string", "sequence", "reuse"])
def test_tritons_example_client_steps_pass(
    server: tuple[ServerProcess, int], example: str, protocol: str
) -> None:
    """simple_*_shm_client.py, simple_*_shm_string_client.py, simple_*_string_infer_client.py,
    simple_*_sequence_sync_infer_client.py, reuse_infer_objects_client.py."""
    run(server, example, protocol)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tritons_model_control_steps_pass(server: tuple[ServerProcess, int], protocol: str) -> None:
    """simple_{http,grpc}_model_control.py, the repository's count being this one's."""
    run(server, "model_control", protocol, "--models", str(len(MODELS)))


def test_tritons_explicit_int8_content_steps_pass(server: tuple[ServerProcess, int]) -> None:
    """grpc_explicit_int8_content_client.py (gRPC only: typed contents)."""
    run(server, "explicit_int8", "grpc")
