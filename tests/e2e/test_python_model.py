"""A Triton-style Python model (backend: "python") on a real server: BYTES in and out through
dynamic batching, its prints in the server's log, its restrictions (scrubbed environment,
open-files limit), and a model.py that raises, crashes or hangs failing only what it must."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from tests.e2e.test_worker_restart import only_instance, wait_for
from tests.servers import ServerProcess, running_server

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "python_model"
TIMEOUT_S = 60.0


def python_repository(target: Path) -> Path:
    (target / "upper" / "1").mkdir(parents=True)
    shutil.copy(FIXTURE / "config.pbtxt", target / "upper" / "config.pbtxt")
    shutil.copy(FIXTURE / "model.py", target / "upper" / "1" / "model.py")
    return target


def infer(server: ServerProcess, *texts: str) -> dict[str, np.ndarray[Any, Any]]:
    text = np.array([[t.encode()] for t in texts], dtype=np.object_)
    response = server.stub.ModelInfer(build_request("upper", {"text": text}), timeout=TIMEOUT_S)
    return parse_response(response)


def test_python_model_serves_bytes_restricted_and_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PADDLEQUIC_TEST_SECRET", "do-not-leak")
    repository = python_repository(tmp_path / "models")
    with running_server(repository, tmp_path / "server.log") as server:
        metadata = server.stub.ModelMetadata(pb.ModelMetadataRequest(name="upper"), timeout=5)
        assert [(t.name, t.datatype) for t in metadata.inputs] == [("text", "BYTES")]
        got = infer(server, "héllo", "", "paddle")
        assert got["upper"].tolist() == [["HÉLLO".encode()], [b""], [b"PADDLE"]]
        assert got["length"].tolist() == [[5], [0], [6]]
        assert got["length"].dtype == np.int32

        assert infer(server, "env")["upper"].tolist() == [[b"absent"]]
        assert infer(server, "files")["length"].tolist() == [[64]]

        with pytest.raises(grpc.RpcError) as raised:
            infer(server, "raise")
        assert raised.value.code() is grpc.StatusCode.INTERNAL
        assert "the text 'raise' is refused on purpose" in (raised.value.details() or "")
        assert infer(server, "still", "fine")["upper"].tolist() == [[b"STILL"], [b"FINE"]]

        pid = only_instance(server, "upper").pid
        with pytest.raises(grpc.RpcError) as crashed:
            infer(server, "crash")
        assert crashed.value.code() is grpc.StatusCode.INTERNAL
        assert "suspected poison input" in (crashed.value.details() or "")
        wait_for(
            "the crashed worker to be restarted",
            lambda: True if only_instance(server, "upper").state == "READY" else None,
        )
        assert only_instance(server, "upper").pid != pid

        # A hang is the watchdog's (execution_timeout_ms 2000 in the fixture's config).
        with pytest.raises(grpc.RpcError) as hung:
            infer(server, "hang")
        assert hung.value.code() is grpc.StatusCode.INTERNAL
        assert "suspected poison input" in (hung.value.details() or "")
        wait_for(
            "the hung worker to be restarted",
            lambda: True if only_instance(server, "upper").state == "READY" else None,
        )
        assert infer(server, "back")["upper"].tolist() == [[b"BACK"]]
        log = server.log_text()
        assert "model upper: initialized upper version 1" in log
        assert "model upper: batch of 3" in log
        assert "do-not-leak" not in log


HALVES_CONFIG = """
name: "halves"
backend: "python"
max_batch_size: 4
input [ { name: "x", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [
  { name: "half", data_type: TYPE_FP16, dims: [ 2 ] },
  { name: "brain", data_type: TYPE_BF16, dims: [ 2 ] }
]
dynamic_batching { }
"""

HALVES_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            brain = (x.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16: the high half
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("half", x.astype(np.float16)),
                pb_utils.Tensor("brain", brain),
            ]))
        return responses
"""


def test_response_datatypes_are_the_declared_ones(tmp_path: Path) -> None:
    """numpy has no bfloat16 (BF16 travels as uint16), so response datatypes come from the
    model's declared outputs: FP16 and BF16 stay labelled as declared."""
    repository = tmp_path / "models"
    (repository / "halves" / "1").mkdir(parents=True)
    (repository / "halves" / "config.pbtxt").write_text(HALVES_CONFIG)
    (repository / "halves" / "1" / "model.py").write_text(HALVES_MODEL)
    x = np.array([[1.5, -2.0], [0.25, 3.0]], np.float32)
    with running_server(repository, tmp_path / "server.log") as server:
        response = server.stub.ModelInfer(build_request("halves", {"x": x}), timeout=TIMEOUT_S)
    assert [(t.name, t.datatype, list(t.shape)) for t in response.outputs] == [
        ("half", "FP16", [2, 2]),
        ("brain", "BF16", [2, 2]),
    ]
    half, brain = response.raw_output_contents
    assert np.frombuffer(half, np.float16).tolist() == x.ravel().tolist()
    restored = (np.frombuffer(brain, np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert restored.tolist() == x.ravel().tolist()
