"""The server's signing policy (OpenSSF model-signing): signed versions load; tampered files or
config, a signature moved to another model, a version the signature does not list and (with
--require-signed) unsigned models are refused with the reason, requests for them get
FAILED_PRECONDITION, and the failures are counted. What a worker loads, at every start and
restart, is the verified copy, never the repository's files."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from service.lifecycle.signatures import generate_keys, sign
from tests.servers import (
    EXAMPLE_MODELS,
    METRICS_PORT,
    REPO_ROOT,
    ServerProcess,
    eventually,
    running_server,
)

REQUEST = {"input": np.linspace(-1, 1, 256, dtype=np.float32)[None, :]}
ALL_VERSIONS = "version_policy: { all: {} }\n"
RESTART_S = 120.0  # a restart loads Paddle again on a busy 2-core machine


def add_model(root: Path, name: str, extra_config: str = "") -> Path:
    target = root / name
    shutil.copytree(EXAMPLE_MODELS / "mlp" / "1", target / "1")
    config = (EXAMPLE_MODELS / "mlp" / "config.pbtxt").read_text()
    (target / "config.pbtxt").write_text(
        config.replace('name: "mlp"', f'name: "{name}"') + extra_config
    )
    return target


def repository(root: Path, key: Path) -> Path:
    """good: signed. tampered: a weight file changed after signing. config: config.pbtxt
    changed after signing (c). impostor: good's files and signature under another name (d).
    partial: signed with version 1, then version 2 added (d). unsigned: never signed.
    labelled: signed with a label file. relabelled: its label file changed after signing."""
    sign(add_model(root, "good"), key)
    sign(add_model(root, "tampered"), key)
    (root / "tampered" / "1" / "inference.pdiparams").write_bytes(b"\0" * 64)
    sign(add_model(root, "config"), key)
    with (root / "config" / "config.pbtxt").open("a") as handle:
        handle.write('parameters { key: "cpu_threads" value: { string_value: "2" } }\n')
    shutil.copytree(root / "good", root / "impostor")
    config = root / "impostor" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "good"', 'name: "impostor"'))
    sign(add_model(root, "partial", ALL_VERSIONS), key)
    shutil.copytree(root / "partial" / "1", root / "partial" / "2")
    add_model(root, "unsigned")
    for name in ("labelled", "relabelled"):  # a label file is served, so it is signed too
        labelled = add_model(root, name)
        config = labelled / "config.pbtxt"
        config.write_text(
            config.read_text().replace(
                "dims: [ 10 ] }", 'dims: [ 10 ], label_filename: "labels.txt" }'
            )
        )
        (labelled / "labels.txt").write_text("".join(f"class {i}\n" for i in range(10)))
        sign(labelled, key)
    (root / "relabelled" / "labels.txt").write_text("forged\n" * 10)
    return root


def infer(server: ServerProcess, model: str, version: str = "") -> bytes:
    request = build_request(model, REQUEST, version=version)
    return bytes(server.stub.ModelInfer(request, timeout=60).raw_output_contents[0])


def refused(server: ServerProcess, model: str, version: str = "") -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        infer(server, model, version)
    return error.value.code()


def index(server: ServerProcess) -> dict[tuple[str, str], pb.RepositoryIndexResponse.ModelIndex]:
    models = server.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10).models
    return {(m.name, m.version): m for m in models}


def signature_failures(metrics_port: int) -> int:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("paddlequic_model_load_failures_total{") and 'reason="signature"' in line
    )


def keys(tmp_path: Path) -> tuple[Path, Path]:
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    generate_keys(tmp_path / "release.key", trusted / "release.pub")
    return tmp_path / "release.key", trusted


@pytest.mark.parametrize("required", [True, False])
def test_signing_policy(tmp_path: Path, required: bool) -> None:
    key, trusted = keys(tmp_path)
    repo = repository(tmp_path / "models", key)
    args = ["--trusted-keys", str(trusted), "--no-h3", "--metrics-port", METRICS_PORT]
    args += ["--require-signed"] if required else []
    with running_server(repo, tmp_path / "server.log", args, wait=False) as server:
        server.wait_loaded()
        models = index(server)
        assert models["good", "1"].state == "READY"
        assert infer(server, "good")
        assert models["labelled", "1"].state == "READY"
        expected = {
            ("tampered", "1"): "tampered/1/inference.pdiparams was modified after signing",
            ("config", "1"): "config/config.pbtxt was modified after signing",
            ("impostor", "1"): "signed for model 'good', not 'impostor'",
            ("partial", "2"): "version 2 is not in the signed manifest",
            ("relabelled", "1"): "relabelled/labels.txt was modified after signing",
        }
        for (name, version), reason in expected.items():
            assert models[name, version].state == "UNAVAILABLE"
            assert reason in models[name, version].reason
            assert refused(server, name, version) == grpc.StatusCode.FAILED_PRECONDITION
        # The version the signature lists serves.
        assert models["partial", "1"].state == "READY"
        assert infer(server, "partial", "1") == infer(server, "good")
        if required:
            assert models["unsigned", "1"].state == "UNAVAILABLE"
            assert "is not signed" in models["unsigned", "1"].reason
        else:
            assert models["unsigned", "1"].state == "READY"
            assert "is not signed (no model.sig); loading it" in server.log_text()
        assert signature_failures(server.metrics_port) == len(expected) + required
        listed = subprocess.run(
            [sys.executable, "-m", "clients.cli", "models", "--url", server.url],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=60,
        )
        for reason in expected.values():  # `paddlequic models` shows the reasons too
            assert reason in listed.stdout


def test_restarts_and_reloads_load_only_verified_bytes(tmp_path: Path) -> None:
    """(a): weights tampered with after the load never serve: not after the worker dies and
    restarts, not after a reload, which refuses them and leaves the verified version serving."""
    key, trusted = keys(tmp_path)
    model = add_model(tmp_path / "models", "good")
    sign(model, key)
    args = ["--trusted-keys", str(trusted), "--require-signed", "--no-h3"]
    with running_server(tmp_path / "models", tmp_path / "server.log", args) as server:
        answer = infer(server, "good")
        weights = model / "1" / "inference.pdiparams"
        weights.write_bytes(bytes(weights.stat().st_size))  # zeros: another answer if loaded
        (before,) = server.instances("good")
        os.kill(before.pid, signal.SIGKILL)
        eventually(
            lambda: [(i.state, i.restarts) for i in server.instances("good")] == [("READY", 1)],
            "the worker to restart",
            RESTART_S,
        )
        assert infer(server, "good") == answer

        server.process.send_signal(signal.SIGHUP)
        eventually(
            lambda: "inference.pdiparams was modified" in index(server)["good", "1"].reason,
            "the reload to refuse the tampered weights",
            RESTART_S,
        )
        assert index(server)["good", "1"].state == "READY"
        assert infer(server, "good") == answer


def ensemble_config(step_model: str, version: int = -1) -> str:
    """One step on `step_model` (an mlp): features -> probs."""
    return f"""
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "input", data_type: TYPE_FP32, dims: [ 256 ] }} ]
output [ {{ name: "probabilities", data_type: TYPE_FP32, dims: [ 10 ] }} ]
ensemble_scheduling {{
  step [
    {{ model_name: "{step_model}" model_version: {version}
      input_map {{ key: "input" value: "input" }}
      output_map {{ key: "probabilities" value: "probabilities" }} }}
  ]
}}
"""


def copies(tmp: Path) -> list[str]:
    """The verified copies under the server's $TMPDIR, as MODEL-VERSION."""
    (directory,) = tmp.glob("paddlequic-verified-*")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    return sorted(p.name.rsplit("-", 1)[0] for p in directory.iterdir())


def test_ensembles_are_signed_like_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ensemble's config.pbtxt (its steps) is signed and checked at start, on SIGHUP and on
    RepositoryModelLoad, a nested one's as any: an unsigned one is refused under
    --require-signed, and a model whose config.pbtxt was changed since signing (its platform,
    to an ensemble; an ensemble's steps) is refused with that reason while what was verified
    goes on serving."""
    key, trusted = keys(tmp_path)
    root = tmp_path / "models"
    sign(add_model(root, "good"), key)
    sign(add_model(root, "victim"), key)
    pair = root / "pair"
    pair.mkdir()
    (pair / "config.pbtxt").write_text(ensemble_config("good"))
    sign(pair, key)
    (root / "outer").mkdir()
    (root / "outer" / "config.pbtxt").write_text(ensemble_config("pair"))  # pair nested
    sign(root / "outer", key)
    for loose, step in (("loose", "good"), ("loose_outer", "pair")):
        (root / loose).mkdir()
        (root / loose / "config.pbtxt").write_text(ensemble_config(step))
    swapped = add_model(root, "swapped")
    sign(swapped, key)
    (swapped / "config.pbtxt").write_text(ensemble_config("good"))  # now answered by "good"
    args = ["--trusted-keys", str(trusted), "--require-signed", "--no-h3"]
    args += ["--model-control-mode", "explicit", "--load-model", "*"]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the server's private copies go there
    with running_server(root, tmp_path / "server.log", args, wait=False) as server:
        server.wait_loaded()
        # What serves has a verified copy (files 0400); refused versions have none.
        assert copies(tmp) == ["good-1", "outer-1", "pair-1", "victim-1"]
        (weights,) = tmp.glob("paddlequic-verified-*/good-1-*/1/inference.pdiparams")
        assert stat.S_IMODE(weights.stat().st_mode) == 0o400
        models = index(server)
        assert models["pair", "1"].state == models["outer", "1"].state == "READY"
        answer = infer(server, "good")
        assert infer(server, "pair") == infer(server, "outer") == answer
        for name, reason in (
            ("loose", "model 'loose' is not signed"),
            ("loose_outer", "model 'loose_outer' is not signed"),
            ("swapped", "swapped/config.pbtxt was modified after signing"),
        ):
            assert models[name, "1"].state == "UNAVAILABLE"
            assert reason in models[name, "1"].reason
            assert refused(server, name) == grpc.StatusCode.FAILED_PRECONDITION

        # After the start: a signed model turned into an ensemble, an ensemble's steps changed.
        (root / "victim" / "config.pbtxt").write_text(ensemble_config("good"))
        (pair / "config.pbtxt").write_text(ensemble_config("good", 1))
        server.process.send_signal(signal.SIGHUP)
        for name in ("victim", "pair"):
            reason = f"{name}/config.pbtxt was modified after signing"
            eventually(
                lambda: reason in index(server)[name, "1"].reason,  # noqa: B023
                f"the reload to refuse {name}'s config.pbtxt",
                RESTART_S,
            )
            with pytest.raises(grpc.RpcError) as error:
                server.stub.RepositoryModelLoad(
                    pb.RepositoryModelLoadRequest(model_name=name), timeout=60
                )
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert reason in str(error.value.details())
            assert index(server)[name, "1"].state == "READY"
            assert infer(server, name) == answer
        metadata = server.stub.ModelMetadata(pb.ModelMetadataRequest(name="victim"), timeout=10)
        assert metadata.platform == "paddle_inference"  # the verified model, not the ensemble
        assert copies(tmp) == ["good-1", "outer-1", "pair-1", "victim-1"]  # refused: none

        server.stub.RepositoryModelUnload(
            pb.RepositoryModelUnloadRequest(model_name="victim"), timeout=60
        )
        eventually(
            lambda: "victim-1" not in copies(tmp), "the unloaded version's copy to go", RESTART_S
        )
    assert not list(tmp.iterdir())  # the server removed its copies when it stopped


def test_a_trusted_keys_file_that_is_not_a_key_stops_the_server(tmp_path: Path) -> None:
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / "notes.pem").write_text("not a key")
    (tmp_path / "models").mkdir()
    server = ServerProcess(
        tmp_path / "models", tmp_path / "server.log", ["--trusted-keys", str(trusted)]
    )
    try:
        assert server.process.wait(120) == 1
    finally:
        server.stop()
    assert "notes.pem is not an ECDSA (P-256, P-384, P-521) public key" in server.log_text()
