"""BLS on a real server: Python models that call other models through their own batchers
(pb_utils.InferenceRequest.exec / async_exec). The mlp_router example answers as mlp does for
the rows it sends there and on its own for the others; a call's errors come back as error
responses (bad inputs, unknown model) while the server stays up; a model calling itself is
stopped by the wait-for-itself check (one instance) or the depth limit (enough instances), never
a hang; a call's deadline is its caller's."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from service.inference.calls import BLS_MAX_DEPTH
from tests.e2e.test_worker_restart import only_instance
from tests.servers import REPO_ROOT, ServerProcess, model_repository, paused, running_server

pytestmark = pytest.mark.e2e

PROBE = Path(__file__).resolve().parents[1] / "fixtures" / "bls"
TIMEOUT_S = 60.0
# Triton's TRITONSERVER_Error_Code values (pb_utils.TritonError)
NOT_FOUND, INVALID_ARG, UNAVAILABLE = 2, 3, 4
# Probes: name -> (target, requested outputs, instances, extra parameters)
PROBES = {
    "to_mlp": ("mlp", "probabilities", 1, ""),
    "to_mlp_async": ("mlp", "probabilities", 1, "async"),
    "to_nowhere": ("nosuch", "probabilities", 1, ""),
    "loop": ("loop", "status,code,output", 1, ""),
    "deep_loop": ("deep_loop", "status,code,output", BLS_MAX_DEPTH + 1, ""),
}


def install_probe(repository: Path, name: str) -> None:
    target, requested, count, extra = PROBES[name]
    (repository / name / "1").mkdir(parents=True)
    shutil.copy(PROBE / "model.py", repository / name / "1" / "model.py")
    parameters = {"target": target, "requested": requested} | ({extra: "1"} if extra else {})
    config = (
        f'name: "{name}"\n'
        + (PROBE / "config.pbtxt").read_text()
        + f"instance_group [ {{ kind: KIND_CPU, count: {count} }} ]\n"
        + "".join(
            f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
            for k, v in parameters.items()
        )
    )
    (repository / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("bls")
    repository = model_repository(root / "models", ["mlp"])
    shutil.copytree(REPO_ROOT / "examples" / "bls" / "mlp_router", repository / "mlp_router")
    for name in PROBES:
        install_probe(repository, name)
    # Explicit model control: a test unloads mlp and loads it again.
    explicit = ["--model-control-mode", "explicit", "--load-model", "*"]
    with running_server(repository, root / "server.log", explicit) as running:
        yield running


def infer(
    server: ServerProcess, model: str, inputs: dict[str, np.ndarray[Any, Any]], **kwargs: Any
) -> dict[str, np.ndarray[Any, Any]]:
    kwargs.setdefault("timeout", TIMEOUT_S)
    return parse_response(server.stub.ModelInfer(build_request(model, inputs), **kwargs))


def probe(server: ServerProcess, model: str, values: np.ndarray[Any, Any]) -> tuple[str, int]:
    got = infer(server, model, {"input": values.astype(np.float32)})
    return got["status"].item().decode(), int(got["code"].item())


def test_router_answers_as_mlp_for_the_rows_it_routes(server: ServerProcess) -> None:
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((4, 256)).astype(np.float32)
    rows[1] = 0.0  # silent: answered by the router itself
    rows[3] *= 1e-3
    got = infer(server, "mlp_router", {"input": rows})
    routed = got["routed"].reshape(-1)
    assert routed.tolist() == [True, False, True, False]
    direct = infer(server, "mlp", {"input": rows[routed]})["probabilities"]
    np.testing.assert_array_equal(got["probabilities"][routed], direct)
    np.testing.assert_array_equal(got["probabilities"][~routed], np.full((2, 10), 0.1, np.float32))

    quiet = infer(server, "mlp_router", {"input": np.zeros((2, 256), np.float32)})
    assert quiet["routed"].tolist() == [[False], [False]]


def test_exec_and_async_exec_return_mlps_answer(server: ServerProcess) -> None:
    row = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
    direct = infer(server, "mlp", {"input": row})["probabilities"]
    for model in ("to_mlp", "to_mlp_async"):
        got = infer(server, model, {"input": row})
        assert got["status"].item() == b"ok"
        np.testing.assert_array_equal(got["output"], direct)


def test_errors_come_back_as_error_responses(server: ServerProcess) -> None:
    status, code = probe(server, "to_mlp", np.ones((1, 3)))
    assert code == INVALID_ARG
    assert "input" in status and "256" in status
    status, code = probe(server, "to_mlp_async", np.ones((1, 3)))
    assert code == INVALID_ARG
    status, code = probe(server, "to_nowhere", np.ones((1, 3)))
    assert (code, "unknown model 'nosuch'" in status) == (NOT_FOUND, True)
    assert probe(server, "to_mlp", np.ones((1, 256)))[0] == "ok"  # the server is still up


def test_a_model_calling_itself_gets_an_error_not_a_hang(server: ServerProcess) -> None:
    status, code = probe(server, "loop", np.ones((1, 2)))
    assert code == UNAVAILABLE
    assert "no instance that could run this BLS call" in status
    status, code = probe(server, "deep_loop", np.ones((1, 2)))
    assert code == UNAVAILABLE
    assert f"nest {BLS_MAX_DEPTH + 1} deep" in status


def test_a_call_has_its_callers_deadline(server: ServerProcess) -> None:
    """mlp held still: the caller's deadline passes and its call is cancelled, which frees
    the caller's only instance at once (its next request is answered while mlp is still held);
    once mlp runs again, calls go through."""
    with paused(only_instance(server, "mlp").pid):
        with pytest.raises(grpc.RpcError) as late:
            infer(server, "to_mlp", {"input": np.ones((1, 256), np.float32)}, timeout=1.5)
        assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert probe(server, "to_mlp", np.ones((1, 3)))[1] == INVALID_ARG
    assert probe(server, "to_mlp", np.ones((1, 256)))[0] == "ok"


def test_the_router_fails_cleanly_without_mlp(server: ServerProcess) -> None:
    """The router passes mlp's error on as its own: its request fails, its silent rows still
    need nothing, and once mlp is back it routes again."""
    rows = np.ones((1, 256), np.float32)
    server.stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="mlp"), timeout=60)
    try:
        with pytest.raises(grpc.RpcError) as failed:
            infer(server, "mlp_router", {"input": rows})
        assert failed.value.code() is grpc.StatusCode.INTERNAL
        assert "model 'mlp' was unloaded" in (failed.value.details() or "")
        quiet = infer(server, "mlp_router", {"input": np.zeros((1, 256), np.float32)})
        assert quiet["routed"].tolist() == [[False]]
    finally:
        server.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mlp"), timeout=60)
    assert infer(server, "mlp_router", {"input": rows})["routed"].tolist() == [[True]]
