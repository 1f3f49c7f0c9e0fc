"""Worker deaths cost no request: a killed worker's requests run again, a hung (stopped) worker
is killed by the watchdog and restarted, an input that crashes the worker twice fails alone
with INTERNAL and then at once, and a model with a bad parameter is UNAVAILABLE while the server
serves the rest: with the server's batcher and with the worker's own queues.

Its own server with copies of `mlp` whose config.pbtxt this file writes: killing workers of the
shared server would disturb other tests.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from tests.e2e.test_worker_restart import only_instance, wait_for
from tests.reference import assert_matches_reference, example_inputs, output_names, run_reference
from tests.servers import EXAMPLE_MODELS, ServerProcess, running_server

RPC_TIMEOUT_S = 120.0
CLIENTS = 32
EXECUTION_TIMEOUT_MS = 3000
POISON = 13.0
MLP_CONFIG = """
max_batch_size: 64
input [ {{ name: "input", data_type: TYPE_FP32, dims: [ 256 ] }} ]
output [ {{ name: "{output}", data_type: TYPE_FP32, dims: [ 10 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
dynamic_batching {{ }}
{parameters}
"""


def parameter(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


def add_mlp_copy(root: Path, name: str, parameters: str) -> None:
    model = root / name
    model.mkdir(parents=True)
    (model / "1").symlink_to(EXAMPLE_MODELS / "mlp" / "1")
    (model / "config.pbtxt").write_text(
        MLP_CONFIG.format(parameters=parameters, output=output_names("mlp")[0])
    )


@pytest.fixture(scope="module", params=["batcher", "instance queues", "front-end queues"])
def repository(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """One per path of the server (see `server`)."""
    models = tmp_path_factory.mktemp(request.param.replace(" ", "-")) / "models"
    add_mlp_copy(
        models,
        "mlp",
        parameter("execution_timeout_ms", str(EXECUTION_TIMEOUT_MS))
        + parameter("testing_crash_on", str(POISON)),
    )
    add_mlp_copy(models, "broken", parameter("cpu_math_threads", "abc"))
    return models


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    """Each test against the server's batcher, then with the worker batching from its own
    queues (--instance-queues), then from the queues two front-ends write into themselves:
    the same promises on every path."""
    log = repository.parent / "server.log"
    batcher = repository.parent.name.startswith("batcher")
    path = ["--no-instance-queues" if batcher else "--instance-queues"]
    if repository.parent.name.startswith("front-end"):
        path += ["--frontends", "2"]
    with running_server(repository, log, ["--testing-service", *path], wait=False) as process:
        process.wait_loaded()
        yield process


def infer(server: ServerProcess, inputs: dict[str, np.ndarray[Any, Any]]) -> pb.ModelInferResponse:
    response: pb.ModelInferResponse = server.stub.ModelInfer(
        build_request("mlp", inputs), timeout=RPC_TIMEOUT_S
    )
    return response


def restarted(server: ServerProcess, old_pid: int) -> int:
    """Wait until the mlp instance runs again in a new process; its pid."""
    instance = wait_for(
        "the mlp instance to be restarted",
        lambda: (
            i if (i := only_instance(server, "mlp")).state == "READY" and i.pid != old_pid else None
        ),
    )
    return instance.pid


def test_a_model_with_a_bad_parameter_is_unavailable_and_the_rest_serves(
    server: ServerProcess,
) -> None:
    index = {m.name: m for m in server.stub.RepositoryIndex(pb.RepositoryIndexRequest()).models}
    assert index["broken"].state == "UNAVAILABLE"
    assert "parameter cpu_math_threads must be an integer, not 'abc'" in index["broken"].reason
    assert index["mlp"].state == "READY"
    with pytest.raises(grpc.RpcError) as refused:
        server.stub.ModelInfer(build_request("broken", example_inputs("mlp")), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "cpu_math_threads" in (refused.value.details() or "")
    inputs = example_inputs("mlp", seed=1)
    assert_matches_reference("mlp", inputs, infer(server, inputs))


def test_a_model_with_a_bad_parameter_found_on_rescan_is_unavailable(
    server: ServerProcess, repository: Path
) -> None:
    add_mlp_copy(repository, "late", parameter("execution_timeout_ms", "soon"))
    server.process.send_signal(signal.SIGHUP)
    late = wait_for(
        "the rescan to report the new model's load",
        # Until its load ends the model is listed by its name alone, as Triton lists a
        # model of the repository it has not loaded.
        lambda: next(
            (
                m
                for m in server.stub.RepositoryIndex(pb.RepositoryIndexRequest()).models
                if m.name == "late" and m.state
            ),
            None,
        ),
    )
    assert late.state == "UNAVAILABLE"
    assert "parameter execution_timeout_ms must be an integer, not 'soon'" in late.reason
    inputs = example_inputs("mlp", seed=2)
    assert_matches_reference("mlp", inputs, infer(server, inputs))


class _Load:
    """CLIENTS threads sending requests back to back, each checking its answers."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.done = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        inputs = [example_inputs("mlp", seed=100 + i) for i in range(CLIENTS)]
        expected = [run_reference("mlp", x)[output_names("mlp")[0]] for x in inputs]
        self._threads = [
            threading.Thread(target=self._client, args=(x, e), daemon=True)
            for x, e in zip(inputs, expected, strict=True)
        ]

    def __enter__(self) -> _Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(RPC_TIMEOUT_S)

    def _client(self, inputs: dict[str, np.ndarray[Any, Any]], expected: Any) -> None:
        request = build_request("mlp", inputs)
        while not self._stop.is_set():
            try:
                response = self.server.stub.ModelInfer(request, timeout=RPC_TIMEOUT_S)
                served = parse_response(response)[output_names("mlp")[0]]
                problem = None if np.allclose(served, expected, 1e-4, 1e-5) else "wrong outputs"
            except grpc.RpcError as exc:
                problem = f"{exc.code()}: {exc.details()}"
            with self._lock:
                self.done += 1
                if problem is not None:
                    self.failures.append(problem)

    def wait_for_more(self, count: int) -> None:
        target = self.done + count
        wait_for(f"{count} more answers", lambda: True if self.done >= target else None)


def test_killing_a_worker_under_load_fails_no_request(server: ServerProcess) -> None:
    pid = only_instance(server, "mlp").pid
    with _Load(server) as load:
        for _ in range(2):
            load.wait_for_more(200)
            os.kill(pid, signal.SIGKILL)
            pid = restarted(server, pid)
        load.wait_for_more(200)
    assert load.failures == [], f"{len(load.failures)} of {load.done} failed: {load.failures[:5]}"
    assert load.done >= 600
    assert server.process.poll() is None


def test_a_stopped_worker_is_killed_by_the_watchdog_and_its_requests_complete(
    server: ServerProcess,
) -> None:
    before = only_instance(server, "mlp")
    os.kill(before.pid, signal.SIGSTOP)
    inputs = [example_inputs("mlp", seed=200 + i) for i in range(4)]
    calls = [
        server.stub.ModelInfer.future(build_request("mlp", x), timeout=RPC_TIMEOUT_S)
        for x in inputs
    ]
    for x, call in zip(inputs, calls, strict=True):
        assert_matches_reference("mlp", x, call.result())
    after = only_instance(server, "mlp")
    assert after.pid != before.pid and after.restarts == before.restarts + 1
    log = server.log_text()
    assert f"(pid {before.pid}) has run one batch for more than 3.0 s" in log
    assert f"(pid {before.pid}) was killed by the watchdog after 3.0 s" in log


def test_a_poison_input_fails_alone_then_at_once(server: ServerProcess) -> None:
    before = only_instance(server, "mlp")
    poison = example_inputs("mlp", seed=300)
    poison["input"][1, 7] = POISON
    others = [example_inputs("mlp", seed=301 + i) for i in range(6)]
    bad = server.stub.ModelInfer.future(build_request("mlp", poison), timeout=RPC_TIMEOUT_S)
    good = [
        server.stub.ModelInfer.future(build_request("mlp", x), timeout=RPC_TIMEOUT_S)
        for x in others
    ]
    error = bad.exception(timeout=RPC_TIMEOUT_S)
    assert isinstance(error, grpc.Call), "the poison input was answered"
    assert error.code() == grpc.StatusCode.INTERNAL
    message = error.details() or ""
    assert "suspected poison input" in message and "model 'mlp' version 1" in message
    for x, call in zip(others, good, strict=True):
        assert_matches_reference("mlp", x, call.result())
    # The same input again: refused without reaching (and crashing) a worker.
    restarts = wait_for(
        "the mlp instance after the crashes",
        lambda: i.restarts if (i := only_instance(server, "mlp")).state == "READY" else None,
    )
    with pytest.raises(grpc.RpcError) as again:
        infer(server, poison)
    assert again.value.code() == grpc.StatusCode.INTERNAL
    assert again.value.details() == message
    assert only_instance(server, "mlp").restarts == restarts == before.restarts + 2
    inputs = example_inputs("mlp", seed=400)
    assert_matches_reference("mlp", inputs, infer(server, inputs))
