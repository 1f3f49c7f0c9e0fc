"""BLS on a real server: Python models that call other models through their own batchers
(pb_utils.InferenceRequest.exec / async_exec). The mlp_router example answers as mlp does for
the rows it sends there and on its own for the others; a call's errors come back as error
responses (bad inputs, unknown model) while the server stays up; a model calling itself is
stopped by the wait-for graph (one instance, or two requests at once on two instances) or the
depth limit (enough instances), never a hang, while a chain of calls that ends is served; a
call's deadline is its caller's; the watchdog counts a model's computing between its calls and
none of its waits on them."""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1 import control_pb2
from service.inference.calls import BLS_MAX_DEPTH
from tests.e2e.test_worker_restart import only_instance
from tests.servers import (
    REPO_ROOT,
    ServerProcess,
    eventually,
    model_repository,
    paused,
    running_server,
)

pytestmark = pytest.mark.e2e

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PROBE = FIXTURES / "bls"
TIMEOUT_S = 60.0
# A deadlock waits for its deadline: a refusal comes long before this one.
DEADLOCK_TIMEOUT_S = 20.0
# Triton's TRITONSERVER_Error_Code values (pb_utils.TritonError)
NOT_FOUND, INVALID_ARG, UNAVAILABLE = 2, 3, 4
# Probes: name -> (target, requested outputs, instances, extra parameters)
PROBES = {
    "to_mlp": ("mlp", "probabilities", 1, ""),
    "to_mlp_async": ("mlp", "probabilities", 1, "async"),
    "to_nowhere": ("nosuch", "probabilities", 1, ""),
    "loop": ("loop", "status,code,output", 1, ""),
    "deep_loop": ("deep_loop", "status,code,output", BLS_MAX_DEPTH + 1, ""),
    "loop_twice": ("loop_twice", "status,code,output", 2, ""),
    "chain_a": ("chain_b", "status,code,output", 2, ""),
    "chain_b": ("mlp", "probabilities", 1, ""),
}
# `busy` spins CHUNK_MS, then calls `sleepy` (SLEEP_MS), as often as its input says; its
# watchdog's limit is BUSY_LIMIT_MS of computing: LIMIT_CHUNKS chunks.
CHUNK_MS, SLEEP_MS, BUSY_LIMIT_MS = 200, 600, 2000
LIMIT_CHUNKS = BUSY_LIMIT_MS // CHUNK_MS


def install(
    repository: Path, name: str, fixture: Path, count: int, parameters: dict[str, str]
) -> None:
    (repository / name / "1").mkdir(parents=True)
    shutil.copy(fixture / "model.py", repository / name / "1" / "model.py")
    config = (
        f'name: "{name}"\n'
        + (fixture / "config.pbtxt").read_text()
        + f"instance_group [ {{ kind: KIND_CPU, count: {count} }} ]\n"
        + "".join(
            f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
            for k, v in parameters.items()
        )
    )
    (repository / name / "config.pbtxt").write_text(config)


def install_probe(repository: Path, name: str) -> None:
    target, requested, count, extra = PROBES[name]
    parameters = {"target": target, "requested": requested} | ({extra: "1"} if extra else {})
    install(repository, name, PROBE, count, parameters)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("bls")
    repository = model_repository(root / "models", ["mlp"])
    shutil.copytree(REPO_ROOT / "examples" / "bls" / "mlp_router", repository / "mlp_router")
    for name in PROBES:
        install_probe(repository, name)
    busy = {
        "target": "sleepy",
        "chunk_ms": str(CHUNK_MS),
        "execution_timeout_ms": str(BUSY_LIMIT_MS),
    }
    install(repository, "busy", FIXTURES / "bls_busy", 1, busy)
    install(repository, "busy_alongside", FIXTURES / "bls_busy", 1, busy | {"alongside": "1"})
    install(repository, "sleepy", FIXTURES / "bls_sleep", 1, {"sleep_ms": str(SLEEP_MS)})
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
    assert (code, "Request for unknown model: 'nosuch'" in status) == (NOT_FOUND, True)
    assert probe(server, "to_mlp", np.ones((1, 256)))[0] == "ok"  # the server is still up


def test_a_model_calling_itself_gets_an_error_not_a_hang(server: ServerProcess) -> None:
    status, code = probe(server, "loop", np.ones((1, 2)))
    assert code == UNAVAILABLE
    assert "no instance that could run this BLS call" in status
    status, code = probe(server, "deep_loop", np.ones((1, 2)))
    assert code == UNAVAILABLE
    assert f"nest {BLS_MAX_DEPTH + 1} deep" in status


def wait_dispatched(server: ServerProcess, model: str, count: int) -> None:
    """Until `count` of the model's requests are in its (paused) workers."""
    request = control_pb2.ListInstancesRequest(model_name=model)

    def dispatched() -> bool:
        queues = server.control.ListInstances(request, timeout=5).queues
        return sum(int(q.in_flight) for q in queues) >= count

    eventually(dispatched, f"{count} requests of {model} in its workers")


def held_at_once(
    server: ServerProcess,
    model: str,
    rows: np.ndarray[Any, Any],
    stubs: list[pb_grpc.GRPCInferenceServiceStub],
) -> list[tuple[str, int]]:
    """A probe of `model` through each stub, sent while its workers are stopped, each instance
    holding one before any runs, so that their calls are in flight at once; their outcomes."""
    with contextlib.ExitStack() as stopped:
        for instance in server.instances(model):
            stopped.enter_context(paused(instance.pid))
        calls = [
            stub.ModelInfer.future(
                build_request(model, {"input": rows}), timeout=DEADLOCK_TIMEOUT_S
            )
            for stub in stubs
        ]
        wait_dispatched(server, model, len(stubs))
    outcomes = []
    for call in calls:
        try:
            got = parse_response(call.result())
        except grpc.RpcError as exc:
            # Both requests waiting for their deadline: the deadlock the graph refuses.
            raise AssertionError(f"{model}: {exc.code()} {exc.details()}") from None
        outcomes.append((got["status"].item().decode(), int(got["code"].item())))
    return outcomes


def test_a_model_with_two_instances_calling_itself_twice_at_once_is_refused_at_once(
    server: ServerProcess,
) -> None:
    """Each instance runs one request that calls the model: whichever call comes second
    could only run on an instance waiting for it (the first goes to the other instance, never
    behind its own caller). It is refused at once, its request ends, the first call runs on the
    freed instance and is refused there in turn: both answer with the refusal, not
    DEADLINE_EXCEEDED."""
    check_refused_at_once(server, [server.stub] * 2)


def check_refused_at_once(
    server: ServerProcess, stubs: list[pb_grpc.GRPCInferenceServiceStub]
) -> None:
    outcomes = held_at_once(server, "loop_twice", np.ones((1, 2), np.float32), stubs)
    for status, code in outcomes:
        assert code == UNAVAILABLE
        assert "no instance that could run this BLS call" in status


def test_with_front_ends_calls_from_each_meet_in_one_graph(tmp_path: Path, certs_dir: Path) -> None:
    """With --frontends 2 the workers and their BLS calls live in the parent, whichever
    front-end took each request: two requests on connections of their own are refused as on
    one process."""
    repository = tmp_path / "models"
    install_probe(repository, "loop_twice")
    args = ["--frontends", "2", "--certs-dir", str(certs_dir)]
    with running_server(repository, tmp_path / "server.log", args) as server:
        channels = [
            grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(2)
        ]
        try:
            check_refused_at_once(server, [pb_grpc.GRPCInferenceServiceStub(c) for c in channels])
        finally:
            for channel in channels:
                channel.close()


def test_a_chain_of_calls_that_ends_is_served_however_many_at_once(server: ServerProcess) -> None:
    """chain_a's two instances each call chain_b (one instance), which calls mlp: four
    requests held until both instances have theirs, then all answered by mlp."""
    rows = np.ones((1, 256), np.float32)
    direct = infer(server, "mlp", {"input": rows})["probabilities"]
    outcomes = held_at_once(server, "chain_a", rows, [server.stub] * 4)
    assert [code for _, code in outcomes] == [-1] * 4
    assert [status for status, _ in outcomes] == ["ok"] * 4
    assert probe(server, "chain_a", rows)[0] == "ok"
    np.testing.assert_array_equal(infer(server, "chain_a", {"input": rows})["output"], direct)


def test_waits_on_bls_calls_are_not_counted_by_the_watchdog(server: ServerProcess) -> None:
    """4 chunks: 0.8 s of computing, 3.2 s in all with its calls, over its 2 s limit."""
    got = infer(server, "busy", {"input": np.full((1, 1), 4, np.float32)})
    assert got["chunks"].tolist() == [4]


@pytest.mark.parametrize(("model", "fewest"), [("busy", LIMIT_CHUNKS // 2), ("busy_alongside", 0)])
def test_a_model_computing_around_bls_calls_is_killed_once_its_computing_reaches_its_limit(
    server: ServerProcess, model: str, fewest: int
) -> None:
    """40 chunks (8 s of computing) with a call after each (`busy`), or with a thread of its
    own keeping a call out all along (`busy_alongside`): the watchdog kills the worker about
    LIMIT_CHUNKS chunks in, at least `fewest`. A clock started afresh after each call would let
    `busy` run all 40 (and answer), one stopped whenever a call is out would let
    `busy_alongside` run them all, and one that counted the waits would kill `busy` 2 or 3
    chunks in. (`busy_alongside` is killed sooner on a loaded machine: its gaps between calls
    count by the wall clock while its chunks last by CPU time.) Killed twice, the request is
    taken for a poison input."""
    with pytest.raises(grpc.RpcError) as failed:
        infer(server, model, {"input": np.full((1, 1), 40, np.float32)}, timeout=120.0)
    assert failed.value.code() is grpc.StatusCode.INTERNAL, failed.value.details()
    log = server.log_text()
    killed = re.search(
        rf"worker {model}_\S* \(pid \d+\) was killed by the watchdog after "
        rf"{BUSY_LIMIT_MS / 1e3:.1f} s of execution",
        log,
    )
    assert killed is not None
    ran = re.findall(rf"model {model}: ran (\d+) chunks", log[: killed.start()])
    # The last chunk before the kill: this request's (the test before runs 4 of `busy`).
    assert fewest <= (int(ran[-1]) if ran else 0) < 40


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
