"""--model-memory-budget against the real server: copies of the example `mlp` (and `kws`, a
sequence model) that declare memory_mb, so each costs a known amount; the budget holds two.
Models load on their first request (or metadata call, an ensemble's step, a BLS call, through
front-end processes too), once whatever the callers; a load that would go over evicts the
least recently used idle model; an evicted model is served again on its next request; a model
with a request in flight, an open sequence, or loaded by RepositoryModelLoad stays; what
happened is counted in the metrics and shown by RepositoryIndex; a model larger than the whole
budget is refused, saying so."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from clients.sequences import SequenceParameters
from protos.inference import grpc_service_pb2 as pb
from protos.paddlequic.v1 import control_pb2
from tests.servers import (
    EXAMPLE_MODELS,
    HTTP_PORT,
    ServerProcess,
    children,
    eventually,
    model_repository,
    paused,
    running_server,
)

MODEL_MB = 300
BUDGET = ["--model-memory-budget", str(2 * MODEL_MB + MODEL_MB // 2)]  # room for two
CALL_TIMEOUT_S = 120.0  # a load on a busy 2-core machine takes seconds
MB = 1 << 20


def copy_model(repository: Path, source: str, name: str, memory_mb: int | None) -> None:
    """`source`'s program under `name`, declaring `memory_mb` (None: measured)."""
    target = repository / name
    target.mkdir(parents=True)
    (target / "1").symlink_to(EXAMPLE_MODELS / source / "1")
    config = (EXAMPLE_MODELS / source / "config.pbtxt").read_text()
    config = config.replace(f'name: "{source}"', f'name: "{name}"')
    # A sequence stays open for a minute of idleness, however slow the machine.
    config = config.replace(
        "max_sequence_idle_microseconds: 5000000", "max_sequence_idle_microseconds: 60000000"
    )
    if memory_mb is not None:
        config += f'parameters {{ key: "memory_mb" value: {{ string_value: "{memory_mb}" }} }}\n'
    (target / "config.pbtxt").write_text(config)


# An ensemble of one step, m1 (an ensemble holds no memory of its own).
ENSEMBLE = """
name: "ens"
platform: "ensemble"
max_batch_size: 64
input [ { name: "input", data_type: TYPE_FP32, dims: [ 256 ] } ]
output [ { name: "probabilities", data_type: TYPE_FP32, dims: [ 10 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "m1"
      model_version: -1
      input_map { key: "input" value: "input" }
      output_map { key: "probabilities" value: "probabilities" }
    }
  ]
}
"""


def mlp_request(name: str) -> pb.ModelInferRequest:
    return build_request(name, {"input": np.linspace(-1, 1, 256, dtype=np.float32)[None, :]})


def kws_request(name: str, sequence: SequenceParameters, end: bool) -> pb.ModelInferRequest:
    frames = np.zeros((1, 8, 40), dtype=np.float32)
    return build_request(name, {"features": frames}, parameters=sequence.next(end=end))


def infer(server: ServerProcess, name: str) -> None:
    response = server.stub.ModelInfer(mlp_request(name), timeout=CALL_TIMEOUT_S)
    assert response.model_name == name


def states(server: ServerProcess) -> dict[str, tuple[str, str]]:
    index = server.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10).models
    return {m.name: (m.state, m.reason) for m in index}


def counted(server: ServerProcess, metric: str, **labels: str) -> float:
    return sum(
        s.value
        for s in server.metrics()
        if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items())
    )


def repository(root: Path, *names: str) -> Path:
    for name in names:
        copy_model(root, "kws" if name.startswith("kws") else "mlp", name, MODEL_MB)
    return root


@pytest.fixture
def three(tmp_path: Path) -> Iterator[ServerProcess]:
    repo = repository(tmp_path / "models", "m1", "m2", "m3")
    with running_server(repo, tmp_path / "log", BUDGET) as server:
        yield server


def test_least_recently_used_idle_model_is_evicted_and_served_again(three: ServerProcess) -> None:
    server = three
    assert {name: state for name, (state, _) in states(server).items()} == {
        "m1": "UNAVAILABLE",
        "m2": "UNAVAILABLE",
        "m3": "UNAVAILABLE",
    }, "nothing loads at start under a budget"
    infer(server, "m1")
    infer(server, "m2")
    infer(server, "m1")  # m2 is now the least recently used
    infer(server, "m3")
    now = states(server)
    assert now["m1"][0] == now["m3"][0] == "READY"
    assert now["m2"][0] == "UNAVAILABLE"
    assert "evicted: least recently used, to make room for 'm3'" in now["m2"][1]
    assert "--model-memory-budget 750 MB" in now["m2"][1]
    assert not server.stub.ModelReady(pb.ModelReadyRequest(name="m2"), timeout=10).ready

    infer(server, "m2")  # served: loaded again, evicting m1 (used before m3)
    now = states(server)
    assert now["m2"][0] == now["m3"][0] == "READY"
    assert now["m1"][0] == "UNAVAILABLE"

    loads = "paddlequic_model_loads_total"
    assert counted(server, loads, model="m2", trigger="request") == 2
    assert counted(server, loads, model="m1", trigger="request") == 1
    evictions = "paddlequic_model_evictions_total"
    assert counted(server, evictions, model="m2") == 1
    assert counted(server, evictions, model="m1") == 1
    assert counted(server, evictions, model="m3") == 0
    assert counted(server, "paddlequic_model_load_waits_total", model="m2") == 2
    memory = "paddlequic_model_memory_bytes"
    assert counted(server, memory, model="m3") == MODEL_MB * MB
    assert counted(server, memory, model="m1") == 0  # not in memory: no series


def test_an_ensemble_loads_its_evicted_step(tmp_path: Path) -> None:
    repo = repository(tmp_path / "models", "m1", "m2", "m3")
    (repo / "ens").mkdir()
    (repo / "ens" / "config.pbtxt").write_text(ENSEMBLE)
    with running_server(repo, tmp_path / "log", BUDGET) as server:
        infer(server, "ens")
        infer(server, "m2")
        infer(server, "m3")  # m1, the ensemble's step, is the least recently used
        assert states(server)["m1"][0] == "UNAVAILABLE"
        infer(server, "ens")
        assert states(server)["m1"][0] == "READY"
        assert counted(server, "paddlequic_model_loads_total", model="m1") == 2


def test_a_bls_call_loads_its_target(tmp_path: Path) -> None:
    """mlp_router (a Python model) calls mlp for rows of norm above 1: mlp, not in memory,
    loads for that call; a Python model's worker is measured too."""
    repo = model_repository(tmp_path / "models", ["mlp_router", "mlp"])
    with running_server(repo, tmp_path / "log", ["--model-memory-budget", "4000"]) as server:
        request = build_request("mlp_router", {"input": np.ones((1, 256), dtype=np.float32)})
        response = server.stub.ModelInfer(request, timeout=CALL_TIMEOUT_S)
        assert parse_response(response)["routed"].tolist() == [[True]]
        assert states(server)["mlp"][0] == "READY"
        memory = "paddlequic_model_memory_bytes"
        assert counted(server, memory, model="mlp_router") > MB
        assert counted(server, memory, model="mlp") > MB


def test_front_end_processes_load_on_demand_too(tmp_path: Path) -> None:
    """With --frontends, a call for a model not in memory goes on to the parent, which loads
    it; calls the front-ends describe count as uses (m1 is used again before m3 loads)."""
    repo = repository(tmp_path / "models", "m1", "m2", "m3")
    with running_server(repo, tmp_path / "log", [*BUDGET, "--frontends", "2"]) as server:
        for name in ("m1", "m2", "m1", "m3"):
            infer(server, name)
        assert {name: state for name, (state, _) in states(server).items()} == {
            "m1": "READY",
            "m2": "UNAVAILABLE",
            "m3": "READY",
        }


def test_metadata_and_config_load_a_model_not_in_memory(three: ServerProcess) -> None:
    """What a client asks before it infers (tritonclient, perf_analyzer) loads the model;
    ModelReady, a health check, does not."""
    server = three
    assert not server.stub.ModelReady(pb.ModelReadyRequest(name="m1"), timeout=10).ready
    metadata = server.stub.ModelMetadata(pb.ModelMetadataRequest(name="m1"), timeout=CALL_TIMEOUT_S)
    assert [t.name for t in metadata.inputs] == ["input"]
    config = server.stub.ModelConfig(pb.ModelConfigRequest(name="m2"), timeout=CALL_TIMEOUT_S)
    assert config.config.name == "m2"
    assert states(server)["m1"][0] == states(server)["m2"][0] == "READY"
    assert states(server)["m3"][0] == "UNAVAILABLE"
    assert counted(server, "paddlequic_model_loads_total", trigger="request") == 2


def test_callers_of_a_loading_model_wait_for_its_one_load(three: ServerProcess) -> None:
    """Requests for a model not in memory while its load cannot finish (the preloaded launcher
    its worker is forked from is stopped): a caller whose deadline passes fails
    DEADLINE_EXCEEDED, the others wait, and one load answers them all."""
    server = three
    infer(server, "m2")  # the preloaded launcher runs from now on
    (launcher,) = (
        pid
        for pid, command in children(server.process.pid).items()
        if "service.workers.preloaded" in command
    )
    waits = "paddlequic_model_load_waits_total"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        with paused(launcher):
            with pytest.raises(grpc.RpcError) as early:
                server.stub.ModelInfer(mlp_request("m1"), timeout=0.5)
            assert early.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            patient = [pool.submit(infer, server, "m1") for _ in range(4)]
            eventually(lambda: counted(server, waits, model="m1") == 5, "every caller waits")
            assert states(server)["m1"][0] == "UNAVAILABLE"
        for call in patient:
            call.result(timeout=CALL_TIMEOUT_S)
    assert counted(server, "paddlequic_model_loads_total", model="m1") == 1


def test_no_eviction_while_a_request_is_in_flight(three: ServerProcess) -> None:
    server = three
    infer(server, "m1")
    infer(server, "m2")
    (instance,) = server.instances("m1")
    with concurrent.futures.ThreadPoolExecutor(1) as pool, paused(instance.pid):
        held = pool.submit(infer, server, "m1")  # held in m1's stopped worker
        eventually(lambda: held_by(server, "m1") == 1, "m1's request reached its worker")
        infer(server, "m3")  # m1 is the least recently used, but busy: m2 goes
        now = states(server)
        assert now["m1"][0] == "READY"
        assert now["m2"][0] == "UNAVAILABLE"
    held.result(timeout=CALL_TIMEOUT_S)


def held_by(server: ServerProcess, model: str) -> int:
    """The model's requests the server holds: in a worker, or queued for one (with
    --instance-queues, a request a stopped worker has not taken is in its queue)."""
    request = control_pb2.ListInstancesRequest(model_name=model)
    queues = server.control.ListInstances(request, timeout=5).queues
    return sum(q.queued + q.in_flight for q in queues)


def test_no_eviction_while_a_sequence_is_open(tmp_path: Path) -> None:
    repo = repository(tmp_path / "models", "kws1", "m1", "m2")
    with running_server(repo, tmp_path / "log", BUDGET) as server:
        sequence = SequenceParameters()
        server.stub.ModelInfer(kws_request("kws1", sequence, end=False), timeout=CALL_TIMEOUT_S)
        infer(server, "m1")
        infer(server, "m2")  # kws1 is the least recently used, its sequence open: m1 goes
        now = states(server)
        assert now["kws1"][0] == "READY"
        assert now["m1"][0] == "UNAVAILABLE"
        server.stub.ModelInfer(kws_request("kws1", sequence, end=True), timeout=CALL_TIMEOUT_S)
        infer(server, "m2")
        infer(server, "m1")  # the sequence ended: kws1, the least recently used, goes now
        assert states(server)["kws1"][0] == "UNAVAILABLE"


def test_a_model_loaded_explicitly_is_pinned(tmp_path: Path) -> None:
    repo = repository(tmp_path / "models", "m1", "m2", "m3")
    args = [*BUDGET, "--model-control-mode", "explicit"]
    with running_server(repo, tmp_path / "log", args) as server:
        server.stub.RepositoryModelLoad(
            pb.RepositoryModelLoadRequest(model_name="m1"), timeout=CALL_TIMEOUT_S
        )
        infer(server, "m2")
        infer(server, "m3")  # m1 is the least recently used, but pinned: m2 goes
        now = states(server)
        assert now["m1"][0] == now["m3"][0] == "READY"
        assert now["m2"][0] == "UNAVAILABLE"
        loads = "paddlequic_model_loads_total"
        assert counted(server, loads, model="m1", trigger="explicit") == 1
        # m3 pinned too (loaded already: nothing loads again): no room left for m2, and the
        # refusal says why.
        server.stub.RepositoryModelLoad(
            pb.RepositoryModelLoadRequest(model_name="m3"), timeout=CALL_TIMEOUT_S
        )
        with pytest.raises(grpc.RpcError) as refused:
            infer(server, "m2")
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (refused.value.details() or "").startswith(
            "model 'm2' needs 300.0 MB and --model-memory-budget 750.0 MB has 150.0 MB free; "
            "the models in use or pinned hold the rest (m1, m3)"
        )


def test_a_budget_too_small_for_one_model_says_so(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    copy_model(repo, "mlp", "declared", MODEL_MB)
    copy_model(repo, "mlp", "measured", None)
    with running_server(repo, tmp_path / "log", ["--model-memory-budget", "1"]) as server:
        for name, size in (("declared", f"{MODEL_MB:.1f} MB"), ("measured", "")):
            for _ in range(2):  # the second is refused before loading: its size is known
                with pytest.raises(grpc.RpcError) as refused:
                    infer(server, name)
                assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                details = refused.value.details() or ""
                assert f"model '{name}' needs {size}" in details
                assert "more than the whole --model-memory-budget of 1.0 MB" in details
            state, reason = states(server)[name]
            assert state == "UNAVAILABLE"
            assert "more than the whole --model-memory-budget" in reason
            assert counted(server, "paddlequic_model_loads_total", model=name) == 1


def test_rest_loads_on_demand_as_grpc_does(tmp_path: Path) -> None:
    """REST infer and metadata load an evicted or never-loaded model, as ModelInfer does."""
    repo = repository(tmp_path / "models", "m1", "m2", "m3")
    args = [*BUDGET, "--http-port", HTTP_PORT]
    body = {
        "inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}]
    }
    with (
        running_server(repo, tmp_path / "log", args) as server,
        httpx.Client(
            base_url=f"http://127.0.0.1:{server.http_port}", timeout=CALL_TIMEOUT_S
        ) as rest,
    ):
        for name in ("m1", "m2", "m3", "m1"):  # m3 evicts m1, which is loaded again
            answer = rest.post(f"/v2/models/{name}/infer", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model_name"] == name
        assert states(server)["m2"][0] == "UNAVAILABLE"  # m1 made room by evicting m2
        assert rest.get("/v2/models/m2").status_code == 200  # its metadata loads it
        assert states(server)["m2"][0] == "READY"
        assert counted(server, "paddlequic_model_loads_total", model="m1") == 2
