"""The server's signing policy: signed versions load, tampered or unsigned ones are refused
with a reason, and requests for them get FAILED_PRECONDITION."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from service.signing import generate_keys, sign
from tests.servers import EXAMPLE_MODELS, running_server

REQUEST = {"input": np.ones((1, 256), np.float32)}


def repository(root: Path, key: Path) -> Path:
    """good: signed; tampered: signed, then a file changed; unsigned: never signed."""
    for name in ("good", "tampered", "unsigned"):
        shutil.copytree(EXAMPLE_MODELS / "mlp" / "1", root / name / "1")
        config = (EXAMPLE_MODELS / "mlp" / "config.pbtxt").read_text()
        (root / name / "config.pbtxt").write_text(config.replace('name: "mlp"', f'name: "{name}"'))
    sign(root / "good" / "1", key)
    sign(root / "tampered" / "1", key)
    (root / "tampered" / "1" / "inference.pdiparams").write_bytes(b"\0" * 64)
    return root


@pytest.mark.parametrize("required", [True, False])
def test_signing_policy(tmp_path: Path, required: bool) -> None:
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    generate_keys(tmp_path / "release.key", trusted / "release.pub")
    repo = repository(tmp_path / "models", tmp_path / "release.key")
    args = ["--trusted-keys", str(trusted), "--no-h3", *(["--require-signed"] if required else [])]
    server_log = tmp_path / "server.log"
    with running_server(repo, server_log, args, wait=False) as server:
        server.wait_loaded()
        index = {m.name: m for m in server.stub.RepositoryIndex(pb.RepositoryIndexRequest()).models}
        assert index["good"].state == "READY"
        assert index["tampered"].state == "UNAVAILABLE"
        assert "inference.pdiparams was modified" in index["tampered"].reason
        assert server.stub.ModelInfer(build_request("good", REQUEST), timeout=30).outputs
        with pytest.raises(grpc.RpcError) as refused:
            server.stub.ModelInfer(build_request("tampered", REQUEST), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        if required:
            assert index["unsigned"].state == "UNAVAILABLE"
            assert "not signed" in index["unsigned"].reason
        else:
            assert index["unsigned"].state == "READY"
            assert "is not signed; loading it" in server.log_text()
