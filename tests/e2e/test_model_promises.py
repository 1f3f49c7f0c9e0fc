"""What the docs promise about models, on one real server: a full model queue answers
RESOURCE_EXHAUSTED, unsampled slow requests are logged, each load failure is counted under its
reason, an ensemble's step may be an ensemble (but not itself), `python_memory_mb` caps a
Python model's worker, its printed lines are capped and its finalize() runs when it is
unloaded; and, on a second, `--no-metrics` opens no metrics port and a stopping server
finalizes its Python models.

The slow model is a Python model that holds every request whose input is 1 until the test
writes a file into its directory: nothing here waits for a duration, only for events."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.inference_client import build_request, parse_response
from clients.quic_channel import QuicChannel
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.e2e.test_worker_restart import wait_for
from tests.servers import METRICS_PORT, ServerProcess, model_repository, running_server

TIMEOUT_S = 60.0
LONG_LINE = 10_000  # characters gate's initialize() prints on one line
FINAL_LINES = 20_000  # lines its finalize() prints as it stops: more than a pipe holds
# A budget (10 s' worth at once) that takes every line finalize() prints, so that its last
# line shows the output was read to its end (test_hostile_workers.py floods past a budget).
OUTPUT_BUDGET = ["--model-output-lines", str(FINAL_LINES // 5)]
MAX_LOG_LINE = 4096  # what the docs promise the server logs of it
WAIT_S = 60.0  # generous, for an event on a loaded machine (models loaded and checked, a line)
GATES = {"h2": "gate", "h3": "gate_h3"}  # a model to hold requests on, per transport
SENT = 8  # requests sent to gate at once; its queue holds 1, its worker 2 batches

GATED_MODEL = """
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.release = os.path.join(args["model_repository"], "release")
        print("long:" + "x" * LONG_LINE, flush=True)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            while (x == 1).any() and not os.path.exists(self.release):
                time.sleep(0.01)  # held until the test releases it
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", x * 2)]))
        return responses

    def finalize(self):
        for line in range(FINAL_LINES):
            print(f"finalizing {line}", flush=True)
        print("finalized", flush=True)
""".replace("LONG_LINE", str(LONG_LINE)).replace("FINAL_LINES", str(FINAL_LINES))

HUNGRY_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "x").as_numpy()
        if (x == 5).any():
            np.empty(2 << 30, np.uint8)  # 2 GiB of address space, beyond python_memory_mb
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", x * 2)])]
"""

RAISING_MODEL = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("initialize refuses on purpose")
"""


def python_config(name: str, extra: str = "") -> str:
    return f"""
name: "{name}"
backend: "python"
max_batch_size: 1
input [ {{ name: "x", data_type: TYPE_FP32, dims: [ 1 ] }} ]
output [ {{ name: "y", data_type: TYPE_FP32, dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
parameters {{ key: "execution_timeout_ms" value: {{ string_value: "120000" }} }}
{extra}
"""


GATE = python_config("gate", "dynamic_batching { default_queue_policy { max_queue_size: 1 } }")
INNER = """
name: "inner"
platform: "ensemble"
max_batch_size: 8
input [ { name: "features", data_type: TYPE_FP32, dims: [ 256 ] } ]
output [ { name: "probs", data_type: TYPE_FP32, dims: [ 10 ] } ]
ensemble_scheduling { step [ { model_name: "mlp" model_version: -1
  input_map { key: "input" value: "features" }
  output_map { key: "probabilities" value: "probs" } } ] }
"""
OUTER = """
name: "outer"
platform: "ensemble"
max_batch_size: 8
input [ { name: "features", data_type: TYPE_FP32, dims: [ 256 ] } ]
output [ { name: "probs", data_type: TYPE_FP32, dims: [ 10 ] } ]
ensemble_scheduling { step [ { model_name: "inner" model_version: -1
  input_map { key: "features" value: "features" }
  output_map { key: "probs" value: "probs" } } ] }
"""
LOOP = OUTER.replace('"outer"', '"loop"').replace('"inner"', '"loop"')  # its step: itself
# model -> (config.pbtxt, model.py or None); each failing one fails at its own stage.
MODELS: dict[str, tuple[str, str | None]] = {
    "gate": (GATE, GATED_MODEL),
    "gate_h3": (GATE.replace('name: "gate"', 'name: "gate_h3"'), GATED_MODEL),
    "finalizer": (python_config("finalizer"), GATED_MODEL),
    "hungry": (
        python_config(
            "hungry", 'parameters { key: "python_memory_mb" value: { string_value: "1024" } }'
        ),
        HUNGRY_MODEL,
    ),
    "broken_config": ("name: 'broken_config' this is not a config", None),
    "broken_load": (python_config("broken_load"), RAISING_MODEL),
    "unplaceable": (
        python_config("unplaceable").replace(
            "{ kind: KIND_CPU, count: 1 }", "{ kind: KIND_GPU, count: 1, gpus: [ 99 ] }"
        ),
        GATED_MODEL,
    ),
    "bad_fallback": (
        python_config(
            "bad_fallback", 'parameters { key: "fallback_model" value: { string_value: "mlp" } }'
        ),
        GATED_MODEL,
    ),
    "inner": (INNER, None),
    "outer": (OUTER, None),
    "loop": (LOOP, None),
}
REASONS = {
    "broken_config": "repository",
    "broken_load": "load",
    "unplaceable": "placement",
    "bad_fallback": "fallback",
    "loop": "ensemble",
}


class Served:
    def __init__(
        self, server: ServerProcess, repository: Path, certs: Path, metrics_port: int
    ) -> None:
        self.server = server
        self.certs = certs
        self.repository = repository
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("model_promises")
    repository = model_repository(root / "models", ["mlp"])
    for name, (config, model) in MODELS.items():
        (repository / name).mkdir()
        (repository / name / "config.pbtxt").write_text(config)
        if model is not None:
            (repository / name / "1").mkdir()
            (repository / name / "1" / "model.py").write_text(model)
    args = [
        *("--metrics-port", METRICS_PORT, "--model-control-mode", "explicit"),
        *("--certs-dir", str(root / "certs")),
        *("--load-model", "*", "--log-sample-ratio", "0", "--slow-request-ms", "0"),
        *OUTPUT_BUDGET,
    ]
    with running_server(repository, root / "server.log", args, wait=False) as server:
        server.wait_loaded()
        yield Served(server, repository, root / "certs", server.metrics_port)


def state(server: ServerProcess, model: str) -> tuple[str, str] | None:
    """(state, reason) of `model` in RepositoryIndex, once it is no longer LOADING or READY
    (an ensemble is READY until its steps are checked)."""
    index = server.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=5).models
    found = [(m.state, m.reason) for m in index if m.name == model]
    return found[0] if found and found[0][0] == "UNAVAILABLE" else None


def log_objects(server: ServerProcess) -> list[dict[str, Any]]:
    return server.log_objects()


def gate_request(value: float, request_id: str, model: str = "gate") -> pb.ModelInferRequest:
    return build_request(model, {"x": np.array([[value]], np.float32)}, request_id=request_id)


def channel(served: Served, transport: str) -> grpc.aio.Channel | QuicChannel:
    """A new channel; create it inside the event loop that uses it."""
    if transport == "h2":
        return grpc.aio.insecure_channel(served.server.address)
    ca_file = str(served.certs / "ca.pem")
    return QuicChannel(f"localhost:{served.server.port}", ca_file=ca_file)


def status(error: BaseException | None) -> tuple[str, str]:
    """A call's failure as plain values (what the assertions compare)."""
    if not isinstance(error, grpc.aio.AioRpcError):
        return ("answered" if error is None else repr(error), "")
    return (error.code().name, error.details() or "")


@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_a_full_model_queue_answers_resource_exhausted(
    served: Served, transport: str
) -> None:
    model = GATES[transport]
    async with channel(served, transport) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        calls = [
            asyncio.ensure_future(
                stub.ModelInfer(gate_request(1.0, f"held-{i}", model), timeout=TIMEOUT_S)
            )
            for i in range(SENT)
        ]
        # At most 3 are held (1 in the queue, 2 batches in the worker): the others are
        # answered while the held ones wait for the release.
        try:
            done: set[asyncio.Future[Any]] = set()
            while len(done) < SENT - 3:
                finished, _ = await asyncio.wait(
                    set(calls) - done, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED
                )
                assert finished, f"no answer in {WAIT_S:.0f} s while {model} held its requests"
                done |= finished
            refused = {status(call.exception()) for call in done}
        finally:
            (served.repository / model / "release").write_text("")
        results = await asyncio.gather(*calls, return_exceptions=True)  # none left running
        assert refused == {("RESOURCE_EXHAUSTED", "the queue holds its maximum of 1 requests")}
        answered = [
            parse_response(r)["y"].tolist() for r in results if isinstance(r, pb.ModelInferResponse)
        ]
        assert {status(r) for r in results if isinstance(r, BaseException)} == refused
        assert answered and all(y == [[2.0]] for y in answered)
        # The queue drained: the next request is served.
        response = await stub.ModelInfer(gate_request(3.0, "after", model), timeout=TIMEOUT_S)
        assert parse_response(response)["y"].tolist() == [[6.0]]


def test_an_unsampled_request_at_least_slow_request_ms_slow_is_logged(served: Served) -> None:
    """`--slow-request-ms 0` and sampling off: every request is at least that slow."""
    response = served.server.stub.ModelInfer(gate_request(2.0, "slow-1"), timeout=TIMEOUT_S)
    assert parse_response(response)["y"].tolist() == [[4.0]]
    (line,) = wait_for(
        "the slow request's log line",
        lambda: [o for o in log_objects(served.server) if o.get("request_id") == "slow-1"] or None,
        WAIT_S,
    )
    assert (line["event"], line["status"], line["model"]) == ("request", "OK", "gate")


def test_each_load_failure_is_counted_under_its_reason(served: Served) -> None:
    for model in REASONS:  # an ensemble fails once its steps are checked, after loading
        wait_for(f"{model} to fail", lambda: state(served.server, model), WAIT_S)  # noqa: B023
    with urllib.request.urlopen(served.metrics_url, timeout=10) as response:
        text = response.read().decode()
    counted = {
        (s.labels["model"], s.labels["reason"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "paddlequic_model_load_failures_total"
    }
    assert counted == {(model, reason): 1.0 for model, reason in REASONS.items()}


def test_an_ensemble_step_may_name_an_ensemble(served: Served) -> None:
    """An ensemble naming another serves (mlp's answer, through both); one naming itself is
    refused at load with the cycle named."""
    found = wait_for("loop to fail", lambda: state(served.server, "loop"), WAIT_S)
    assert "ensemble step cycle: loop -> loop" in found[1]
    stub = served.server.stub
    assert stub.ModelReady(pb.ModelReadyRequest(name="outer"), timeout=5).ready
    features = np.random.default_rng(22).standard_normal((1, 256), dtype=np.float32)
    answers = [
        parse_response(stub.ModelInfer(build_request(m, {"features": features}), timeout=TIMEOUT_S))
        for m in ("outer", "inner")
    ]
    mlp = parse_response(
        stub.ModelInfer(build_request("mlp", {"input": features}), timeout=TIMEOUT_S)
    )
    for answer in answers:
        np.testing.assert_allclose(answer["probs"], mlp["probabilities"], rtol=1e-4, atol=1e-5)


def test_python_memory_mb_caps_a_python_models_worker(served: Served) -> None:
    stub = served.server.stub
    pid = [i.pid for i in served.server.instances("hungry")]
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(
            build_request("hungry", {"x": np.array([[5.0]], np.float32)}), timeout=TIMEOUT_S
        )
    assert refused.value.code() is grpc.StatusCode.INTERNAL
    assert "Unable to allocate 2.00 GiB" in (refused.value.details() or "")
    # The same worker goes on serving, and so does the server.
    response = stub.ModelInfer(
        build_request("hungry", {"x": np.array([[3.0]], np.float32)}), timeout=TIMEOUT_S
    )
    assert parse_response(response)["y"].tolist() == [[6.0]]
    assert [i.pid for i in served.server.instances("hungry")] == pid
    assert stub.ServerLive(pb.ServerLiveRequest(), timeout=5).live


def test_a_python_models_printed_line_is_capped(served: Served) -> None:
    (message,) = [
        o["message"]
        for o in log_objects(served.server)
        if o.get("logger") == "paddlequic.model" and o["message"].startswith("model gate: long:")
    ]
    assert message == "model gate: " + ("long:" + "x" * LONG_LINE)[:MAX_LOG_LINE]
    # The rest is dropped, not logged as a line of its own.
    assert not [
        o for o in log_objects(served.server) if o["message"].startswith("model gate: xxxx")
    ]


def test_finalize_runs_when_a_python_model_is_unloaded(served: Served) -> None:
    stub = served.server.stub
    response = stub.ModelInfer(
        build_request("finalizer", {"x": np.array([[4.0]], np.float32)}), timeout=TIMEOUT_S
    )
    assert parse_response(response)["y"].tolist() == [[8.0]]
    stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="finalizer"), timeout=30)
    wait_for(
        "finalize()'s line in the log",
        lambda: "model finalizer: finalized" in served.server.log_text() or None,
        WAIT_S,
    )


def test_no_metrics_opens_no_metrics_port_serves_and_finalizes_at_stop(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    (repository / "gate" / "1").mkdir(parents=True)
    (repository / "gate" / "config.pbtxt").write_text(GATE)
    (repository / "gate" / "1" / "model.py").write_text(GATED_MODEL)
    args = ["--no-metrics", "--metrics-port", METRICS_PORT, "--no-h3", *OUTPUT_BUDGET]
    with running_server(repository, tmp_path / "server.log", args) as server:
        response = server.stub.ModelInfer(gate_request(2.0, "unmetered"), timeout=TIMEOUT_S)
        assert parse_response(response)["y"].tolist() == [[4.0]]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.metrics_port), timeout=10).close()
        assert "/metrics" not in server.log_text()
    # A stopping server finalizes its Python models too, and logs every line they print
    # while they stop (their output is read to its end, not cut off at their exit).
    assert "model gate: finalized" in (tmp_path / "server.log").read_text()
