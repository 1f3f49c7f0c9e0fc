"""The circuit breaker on a real server: a model whose files are removed while it runs (its
worker then cannot restart) is open-circuited at once; requests for it go to its fallback
model (or fail at once with UNAVAILABLE when it has none); once the files are back, the worker
restarts, the half-open probes succeed and the model answers again itself.

Starts its own server: it kills workers and removes model files.
"""

from __future__ import annotations

import os
import shutil
import signal
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from protos.paddlequic.v1 import control_pb2
from tests.e2e.test_worker_restart import only_instance, wait_for
from tests.servers import EXAMPLE_MODELS, METRICS_PORT, ServerProcess, paused, running_server

Inputs = dict[str, np.ndarray[Any, Any]]
RPC_TIMEOUT_S = 60.0
BREAKER = """
parameters { key: "breaker_min_requests" value: { string_value: "2" } }
parameters { key: "breaker_open_s" value: { string_value: "0.5" } }
"""


def copy_mlp(repository: Path, name: str, extra: str = "") -> None:
    """A copy of the mlp example (files copied: the test removes them) under another name."""
    target = repository / name
    shutil.copytree(EXAMPLE_MODELS / "mlp" / "1", target / "1")
    config = (EXAMPLE_MODELS / "mlp" / "config.pbtxt").read_text()
    (target / "config.pbtxt").write_text(config.replace('"mlp"', f'"{name}"') + extra)


def infer(server: ServerProcess, model: str, inputs: Inputs) -> pb.ModelInferResponse:
    response: pb.ModelInferResponse = server.stub.ModelInfer(
        build_request(model, inputs), timeout=RPC_TIMEOUT_S
    )
    return response


def breaker_of(server: ServerProcess, model: str) -> str:
    request = control_pb2.ListInstancesRequest(model_name=model)
    (queue,) = server.control.ListInstances(request, timeout=5).queues
    return str(queue.breaker)


def by_fallback(response: pb.ModelInferResponse) -> bool:
    parameter = response.parameters.get("fallback")
    return parameter is not None and parameter.bool_param


@pytest.mark.parametrize("frontends", [1, 2])
def test_breaker_opens_falls_back_and_closes_again(tmp_path: Path, frontends: int) -> None:
    """With front-ends, `primary`, its fallback and `lonely` are served in them, each front-end
    with its own breakers (shown as the worst of every process's by ListInstances and
    /metrics): `primary` is answered by its fallback with the parent held still."""
    repository = tmp_path / "models"
    fallback = 'parameters { key: "fallback_model" value: { string_value: "backup" } }'
    copy_mlp(repository, "primary", BREAKER + fallback)
    copy_mlp(repository, "lonely", BREAKER)
    copy_mlp(repository, "backup")
    inputs = {"input": np.random.default_rng(3).standard_normal((2, 256), dtype=np.float32)}
    args = ["--metrics-port", METRICS_PORT, "--frontends", str(frontends)]
    with running_server(repository, tmp_path / "server.log", args) as server:
        expected = parse_response(infer(server, "backup", inputs))["probabilities"]
        healthy = infer(server, "primary", inputs)
        assert (healthy.model_name, by_fallback(healthy)) == ("primary", False)
        assert breaker_of(server, "primary") == "CLOSED"

        # The files go away and the workers die: their restarts fail from now on.
        for name in ("primary", "lonely"):
            (repository / name / "1").rename(repository / name / "away")
            os.kill(only_instance(server, name).pid, signal.SIGKILL)

        answered = wait_for(
            "a request for primary to be answered by its fallback",
            lambda: answer_of(server, inputs, fallback=True),
        )
        assert (answered.model_name, answered.model_version) == ("backup", "1")
        np.testing.assert_allclose(parse_response(answered)["probabilities"], expected, rtol=1e-5)
        assert breaker_of(server, "primary") in ("OPEN", "HALF_OPEN")
        samples = scrape(server.metrics_port)
        assert samples[("paddlequic_fallbacks_total", "primary", "backup")] >= 1
        assert samples[("paddlequic_breaker_state", "primary", "CLOSED")] == 0
        if frontends > 1:  # the front-end holding this test's connection falls back itself
            with paused(server.process.pid):
                wait_for(
                    "primary to be answered by its fallback with the parent stopped",
                    lambda: answer_of(server, inputs, fallback=True),
                )

        # Without a fallback: UNAVAILABLE at once, not a wait for the deadline.
        with pytest.raises(grpc.RpcError) as caught:
            for _ in range(5):
                infer(server, "lonely", inputs)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        wait_for(
            "lonely to be open-circuited",
            lambda: True if open_circuited(server, inputs) else None,
        )
        assert breaker_of(server, "lonely") in ("OPEN", "HALF_OPEN")
        assert scrape(server.metrics_port)[("paddlequic_breaker_state", "lonely", "CLOSED")] == 0

        # Back: the worker restarts, a half-open probe succeeds and the breaker closes.
        (repository / "primary" / "away").rename(repository / "primary" / "1")
        wait_for(
            "primary's worker to restart",
            lambda: True if only_instance(server, "primary").state == "READY" else None,
        )
        again = wait_for(
            "primary to answer itself again", lambda: answer_of(server, inputs, fallback=False)
        )
        assert again.model_name == "primary"
        np.testing.assert_allclose(parse_response(again)["probabilities"], expected, rtol=1e-5)
        assert breaker_of(server, "primary") == "CLOSED"
        assert scrape(server.metrics_port)[("paddlequic_breaker_state", "primary", "CLOSED")] == 1


def scrape(port: int) -> dict[tuple[str, ...], float]:
    """Breaker and fallback samples by (name, model, state or fallback)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, s.labels["model"], s.labels.get("state") or s.labels.get("fallback", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in ("paddlequic_breaker_state", "paddlequic_fallbacks_total")
    }


def answer_of(
    server: ServerProcess,
    inputs: Inputs,
    fallback: bool,
) -> pb.ModelInferResponse | None:
    """A response for primary, if it came (from its fallback or not, as asked); until the
    breaker opens, requests fail with the worker's UNAVAILABLE."""
    try:
        response = infer(server, "primary", inputs)
    except grpc.RpcError as exc:
        assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
        return None
    return response if by_fallback(response) == fallback else None


def open_circuited(server: ServerProcess, inputs: Inputs) -> bool:
    try:
        infer(server, "lonely", inputs)
    except grpc.RpcError as exc:
        return exc.code() is grpc.StatusCode.UNAVAILABLE and "open-circuited" in (
            exc.details() or ""
        )
    return False
