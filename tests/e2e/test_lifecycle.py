"""Model lifecycle against the real server: hot reload under load without a failed request, a
broken version that leaves the old one serving, SIGHUP and polling, unload."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from tests.reference import output_names
from tests.servers import EXAMPLE_MODELS, REPO_ROOT, ServerProcess, eventually, running_server

REQUEST = build_request("mlp", {"input": np.linspace(-1, 1, 256, dtype=np.float32)[None, :]})
CLIENTS = 16


def repository(root: Path) -> Path:
    shutil.copytree(EXAMPLE_MODELS / "mlp", root / "mlp", ignore=shutil.ignore_patterns("[2-9]"))
    return root


def publish(repo: Path, version: int) -> None:
    """Export elsewhere, then rename into place: the server never sees half a version."""
    staging = repo.parent / f"staging-{version}"
    shutil.copytree(repo / "mlp", staging / "mlp", ignore=shutil.ignore_patterns("[0-9]*"))
    shutil.copytree(repo / "mlp" / "1", staging / "mlp" / "1")
    command = [sys.executable, "scripts/export_models.py", "--out", str(staging)]
    command += ["--only", "mlp", "--add-version", str(version)]
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True, timeout=120)
    os.replace(staging / "mlp" / str(version), repo / "mlp" / str(version))


def serving_version(server: ServerProcess) -> str:
    return str(server.stub.ModelInfer(REQUEST, timeout=30).model_version)


class Load:
    """CLIENTS threads sending the same request continuously, recording every answer."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.stop = threading.Event()
        self.answers: list[tuple[str, bytes]] = []
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run) for _ in range(CLIENTS)]

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                response = self.server.stub.ModelInfer(REQUEST, timeout=60)
            except grpc.RpcError as exc:
                self.failures.append(f"{exc.code()}: {exc.details()}")
                continue
            output = parse_response(response)[output_names("mlp")[0]].tobytes()
            self.answers.append((response.model_version, output))

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        eventually(lambda: len(self.answers) >= CLIENTS, "the clients got answers")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def test_hot_reload_under_load_then_a_broken_version(tmp_path: Path) -> None:
    repo = repository(tmp_path / "models")
    args = ["--model-control-mode", "explicit", "--load-model", "mlp", "--no-h3"]
    with running_server(repo, tmp_path / "log", args) as server:
        with Load(server) as load:
            publish(repo, 2)
            server.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mlp"))
            swapped_at = len(load.answers)
            eventually(lambda: len(load.answers) > swapped_at + 4 * CLIENTS, "answers after swap")
        assert load.failures == []
        outputs = {version: {out for v, out in load.answers if v == version} for version in "12"}
        assert set(v for v, _ in load.answers) == {"1", "2"}
        assert len(outputs["1"]) == 1 and len(outputs["2"]) == 1  # each answer from one version
        assert outputs["1"] != outputs["2"]
        # Answers that were in flight at the swap may still come from 1; later ones never do.
        assert all(v == "2" for v, _ in load.answers[swapped_at + 2 * CLIENTS :])
        assert serving_version(server) == "2"

        (repo / "mlp" / "3").mkdir()
        shutil.copy(repo / "mlp" / "2" / "inference.json", repo / "mlp" / "3")
        params = (repo / "mlp" / "2" / "inference.pdiparams").read_bytes()
        (repo / "mlp" / "3" / "inference.pdiparams").write_bytes(params[: len(params) // 2])
        with Load(server) as load:
            with pytest.raises(grpc.RpcError) as failed:
                server.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mlp"))
            assert failed.value.code() == grpc.StatusCode.INTERNAL
            assert "version 3" in (failed.value.details() or "")
        assert load.failures == []
        assert {v for v, _ in load.answers} == {"2"}
        # Asked again with the same broken files: the same error, and 2 still serves.
        with pytest.raises(grpc.RpcError) as again:
            server.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mlp"))
        assert again.value.code() == grpc.StatusCode.INTERNAL
        assert serving_version(server) == "2"
        index = server.stub.RepositoryIndex(pb.RepositoryIndexRequest()).models
        broken = [m for m in index if m.version == "3"]
        assert broken and broken[0].state == "UNAVAILABLE" and broken[0].reason


def test_unload_and_load_again(tmp_path: Path) -> None:
    repo = repository(tmp_path / "models")
    args = ["--model-control-mode", "explicit", "--load-model", "mlp", "--no-h3"]
    with running_server(repo, tmp_path / "log", args) as server:
        pids = [i.pid for i in server.instances("mlp")]
        server.stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="mlp"))
        with pytest.raises(grpc.RpcError) as gone:
            server.stub.ModelInfer(REQUEST, timeout=30)
        assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "unloaded" in (gone.value.details() or "")
        eventually(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), "workers exit")
        server.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mlp"))
        assert serving_version(server) == "1"
        for name in ("../x", "x/../../y", ".."):
            with pytest.raises(grpc.RpcError) as refused:
                server.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=name))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as refused:
                server.stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=name))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_sighup_picks_up_a_new_version(tmp_path: Path) -> None:
    repo = repository(tmp_path / "models")
    with running_server(repo, tmp_path / "log", ["--no-h3"]) as server:
        with pytest.raises(grpc.RpcError) as refused:  # control mode none: no explicit loads
            server.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mlp"))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        publish(repo, 2)
        server.process.send_signal(signal.SIGHUP)
        eventually(lambda: serving_version(server) == "2", "version 2 serves after SIGHUP")


def test_polling_picks_up_a_new_version(tmp_path: Path) -> None:
    repo = repository(tmp_path / "models")
    args = ["--model-control-mode", "poll", "--poll-repository", "0.2", "--no-h3"]
    with running_server(repo, tmp_path / "log", args) as server:
        assert serving_version(server) == "1"
        publish(repo, 2)
        eventually(lambda: serving_version(server) == "2", "version 2 serves after a poll")


def test_the_index_lists_every_model_of_the_repository_in_every_mode(tmp_path: Path) -> None:
    """As Triton lists them: a model added after start (control mode none, no SIGHUP yet) by
    its name alone, a served one with its version and state; `ready` keeps only the ready.
    (Explicit mode: tests/interop/test_tritonclient_triton.py.)"""
    repo = repository(tmp_path / "models")
    with running_server(repo, tmp_path / "log", ["--no-h3"]) as server:
        (repo / "later").symlink_to(EXAMPLE_MODELS / "mlp")
        every = server.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10).models
        ready = server.stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=10)
    assert [(m.name, m.version, m.state) for m in every] == [
        ("later", "", ""),
        ("mlp", "1", "READY"),
    ]
    assert [m.name for m in ready.models] == ["mlp"]
