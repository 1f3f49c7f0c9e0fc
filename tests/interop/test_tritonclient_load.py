"""RepositoryModelLoad's parameters as Triton takes them, with tritonclient itself
(tritonclient_load_check.py, in its own process): `config` (a ModelConfig in JSON) replaces
config.pbtxt for the load, and `file:PATH` sends the model's files, which are bounded per
request, confined to a fresh private directory and under the signing policy like files on
disk; the server stays up through every refusal."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format, text_format

from protos.inference import model_config_pb2 as mc
from service.lifecycle.signatures import generate_keys, sign
from tests.servers import REPO_ROOT, running_server

SCRIPT = Path(__file__).with_name("tritonclient_load_check.py")
SIMPLE = Path(__file__).resolve().parents[1] / "fixtures" / "simple"
CHECK_TIMEOUT_S = 300
MAX_UPLOAD_BYTES = 4096  # the fixture's model.py fits; the oversized upload does not
MAX_UPLOAD_FILES = 4


def checked(
    root: Path, extra_args: list[str], mode: str, more: tuple[str, ...] = ()
) -> dict[str, Any]:
    repository = root / "models"
    (repository / "simple" / "1").mkdir(parents=True)
    shutil.copy(SIMPLE / "config.pbtxt", repository / "simple" / "config.pbtxt")
    shutil.copy(SIMPLE / "model.py", repository / "simple" / "1" / "model.py")
    args = ["--no-h3", "--model-control-mode", "explicit", *extra_args]
    with running_server(repository, root / "server.log", args) as server:
        out = root / "summary.json"
        command = [sys.executable, str(SCRIPT), "--url", server.address, "--out", str(out)]
        command += ["--model-py", str(SIMPLE / "model.py"), "--mode", mode, *more]
        command += ["--server-log", str(server.log_path), "--server-pid", str(server.process.pid)]
        finished = subprocess.run(
            command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
        )
        assert finished.returncode == 0, finished.stderr
        assert server.process.poll() is None
        return dict(json.loads(out.read_text()))


@pytest.fixture(scope="module", params=["1", "2"], ids=["frontends-1", "frontends-2"])
def summary(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Any]:
    """The parameters travel through front-end processes (--frontends 2) as they do without."""
    limits = ["--frontends", request.param, "--max-upload-bytes", str(MAX_UPLOAD_BYTES)]
    limits += ["--max-upload-files", str(MAX_UPLOAD_FILES), "--load-model", "simple"]
    return checked(tmp_path_factory.mktemp("load-parameters"), limits, "plain")


def test_a_good_config_override_applies(summary: dict[str, Any]) -> None:
    assert summary["good"] is None
    assert summary["good_max_batch_size"] == 4  # config.pbtxt says 8
    assert summary["good_sums"] == [i + 1 for i in range(16)]
    # A rescan (SIGHUP) leaves a model loaded with its own config as it is.
    assert summary["rescan_kept"] is True
    assert summary["rescanned_max_batch_size"] == 4
    # Triton's simple_grpc_model_control.py's override, which leaves the tensors out
    assert summary["example"] is None
    assert summary["example_max_batch_size"] == 16
    # The next load without a `config` loads config.pbtxt again, though no file changed.
    assert summary["reloaded_max_batch_size"] == 8


def test_a_bad_config_override_fails_to_load(summary: dict[str, Any]) -> None:
    """Malformed JSON (Triton's simple_grpc_model_control.py sends this one) and a config
    that cannot be served; `simple` serves on, with the override that applied."""
    for key in ("bad_json", "bad_config"):
        assert summary[key]["message"].startswith("failed to load 'simple'"), summary[key]
    assert "onnxruntime" in summary["bad_config"]["message"]


def test_uploaded_files_load_as_the_models_directory(summary: dict[str, Any]) -> None:
    assert summary["upload"] is None
    assert summary["upload_max_batch_size"] == 2
    assert summary["upload_sums"] == [i + 1 for i in range(16)]


def test_uploaded_paths_stay_inside_the_models_directory(summary: dict[str, Any]) -> None:
    for key in ("traversal", "absolute", "dot"):
        refused = summary[key]
        assert refused["status"] == "StatusCode.INVALID_ARGUMENT", refused
        assert refused["message"].startswith(
            "failed to load 'uploaded', failed to poll from model repository: uploaded path"
        ), refused
    assert not summary["refused_left_unloaded"]
    assert summary["live"]


def test_uploads_are_bounded_in_bytes_and_count(summary: dict[str, Any]) -> None:
    """Past a bound, Triton's answer to an upload too large: INTERNAL, failed to poll."""
    for key, flag in (("oversized", "--max-upload-bytes"), ("too_many", "--max-upload-files")):
        refused = summary[key]
        assert refused["status"] == "StatusCode.INTERNAL", refused
        assert refused["message"].startswith(
            "failed to load 'uploaded', failed to poll from model repository"
        )
        assert flag in refused["message"]


def test_files_need_the_config_parameter(summary: dict[str, Any]) -> None:
    refused = summary["files_without_config"]
    assert refused["message"].startswith("failed to load 'uploaded'")
    assert "`config`" in refused["message"]


def signed_upload(root: Path, key: Path) -> Path:
    """config.json for the load, and the model.sig of the directory the server writes from
    it: config.pbtxt (the JSON as text format) and 1/model.py."""
    config = {
        "name": "uploaded",
        "backend": "python",
        "max_batch_size": 2,
        "input": [{"name": f"INPUT{i}", "data_type": "TYPE_INT32", "dims": [16]} for i in (0, 1)],
        "output": [{"name": f"OUTPUT{i}", "data_type": "TYPE_INT32", "dims": [16]} for i in (0, 1)],
    }
    model = root / "staging" / "uploaded"
    (model / "1").mkdir(parents=True)
    shutil.copy(SIMPLE / "model.py", model / "1" / "model.py")
    parsed = json_format.Parse(json.dumps(config), mc.ModelConfig())
    (model / "config.pbtxt").write_text(text_format.MessageToString(parsed))
    sign(model, key)
    (root / "signed").mkdir()
    (root / "signed" / "config.json").write_text(json.dumps(config))
    shutil.copy(model / "model.sig", root / "signed" / "model.sig")
    return root / "signed"


def test_uploads_are_under_the_signing_policy(tmp_path: Path) -> None:
    """Under --require-signed: refused unsigned, or with a file changed since signing; loaded
    with a model.sig by a trusted key, as a model on disk."""
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    generate_keys(tmp_path / "release.key", trusted / "release.pub")
    signed_dir = signed_upload(tmp_path, tmp_path / "release.key")
    args = ["--trusted-keys", str(trusted), "--require-signed"]
    answered = checked(tmp_path, args, "signed", ("--signed-dir", str(signed_dir)))
    for key in ("upload", "tampered"):
        assert answered[key]["message"].startswith("load failed for model 'uploaded'")
        assert "signature refused" in answered[key]["message"], answered[key]
    assert answered["ready"] is False and answered["ready_tampered"] is False
    assert answered["signed"] is None
    assert answered["ready_signed"] is True
    assert answered["live"]


def test_uploads_only_where_the_model_repository_category_is_allowed(tmp_path: Path) -> None:
    restriction = ["--restricted-protocol", "model-repository:admin-key=SECRET"]
    answered = checked(tmp_path, restriction, "restricted")
    assert answered["without_key"]["status"] == "StatusCode.UNAUTHENTICATED"
    assert answered["ready_without_key"] is False
    assert answered["with_key"] is None
    assert answered["ready_with_key"] is True


def test_uploaded_directories_go_when_nothing_serves_from_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One directory held while its version serves; a failed load's removed at once; the
    first removed once a later load replaced its version; none after the unload, or after
    the server stops."""
    watch = tmp_path / "tmp"
    watch.mkdir()
    monkeypatch.setenv("TMPDIR", str(watch))
    answered = checked(tmp_path, [], "lifetime", ("--watch", str(watch)))
    assert answered["broken"]["message"].startswith("load failed for model 'uploaded'")
    assert answered["ready_after_broken"] is True  # the first upload serves on
    assert [answered[k] for k in ("loaded", "after_broken", "replaced", "unloaded")] == [1, 1, 1, 0]
    assert list(watch.glob("paddlequic-upload-*")) == []
