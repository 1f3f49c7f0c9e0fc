"""python_instance_queues: a Python model that says it makes no BLS calls, or says nothing
and whose code names none, takes its requests through its instances' queues, as a Paddle model
does, so with --frontends N the front-end holding a call writes it there and the parent takes
no part. Beside it, the same model without the parameter, whose code names a BLS call, served
as before: both answer alike, and only the queued one refuses BLS calls, naming the
parameter."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from tests.e2e.test_worker_restart import only_instance, wait_for
from tests.servers import ServerProcess, paused, running_server, wait_arrived

TIMEOUT_S = 60.0
FIXTURES = Path(__file__).parent.parent / "fixtures"
CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
input [
  {{ name: "INPUT0", data_type: TYPE_INT32, dims: [ 16 ] }},
  {{ name: "INPUT1", data_type: TYPE_INT32, dims: [ 16 ] }}
]
output [
  {{ name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 16 ] }},
  {{ name: "OUTPUT1", data_type: TYPE_INT32, dims: [ 16 ] }}
]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
dynamic_batching {{ }}
{parameters}
"""
QUEUED = 'parameters { key: "python_instance_queues" value: { string_value: "true" } }'
# INPUT0 holding -1: the model asks `simple` through a BLS call; -2: it answers an error.
MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            first = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            second = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            if (first == -2).any():
                error = pb_utils.TritonError("told to fail")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            if (first == -1).any():
                call = pb_utils.InferenceRequest(
                    model_name="simple",
                    requested_output_names=["OUTPUT0"],
                    inputs=[pb_utils.Tensor("INPUT0", first), pb_utils.Tensor("INPUT1", second)],
                )
                answer = call.exec()
                first = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy() - second
            outputs = [
                pb_utils.Tensor("OUTPUT0", first + second),
                pb_utils.Tensor("OUTPUT1", first - second),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
"""


class Served(NamedTuple):
    server: ServerProcess
    frontends: int


def repository(root: Path) -> Path:
    """`queued` and `plain` (which says nothing, and whose code names a BLS call), `simple`
    (their BLS calls' target, which says nothing and whose code names none), `upper` (BYTES
    tensors) asking for the queues, and `decoupled` asking for them too, which they do not
    take."""
    shutil.copytree(FIXTURES / "simple", root / "simple" / "1")
    shutil.move(root / "simple" / "1" / "config.pbtxt", root / "simple" / "config.pbtxt")
    shutil.copytree(FIXTURES / "python_model", root / "upper" / "1")
    shutil.move(root / "upper" / "1" / "config.pbtxt", root / "upper" / "config.pbtxt")
    shutil.copytree(FIXTURES / "python_decoupled", root / "decoupled")
    for name in ("upper", "decoupled"):
        with (root / name / "config.pbtxt").open("a") as config:
            config.write(f"\n{QUEUED}\n")
    for name, parameters in (("queued", QUEUED), ("plain", "")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(MODEL)
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, parameters=parameters))
    return root


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "frontends-2"])
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("python_queues")
    args = ["--no-h3", "--frontends", str(request.param)]
    with running_server(repository(root / "models"), root / "server.log", args) as server:
        yield Served(server, request.param)


def infer(server: ServerProcess, model: str, first: int) -> dict[str, Any]:
    inputs = {
        "INPUT0": np.full((1, 16), first, np.int32),
        "INPUT1": np.arange(16, dtype=np.int32).reshape(1, 16),
    }
    return parse_response(server.stub.ModelInfer(build_request(model, inputs), timeout=TIMEOUT_S))


def refusal(server: ServerProcess, model: str, first: int) -> tuple[grpc.StatusCode, str]:
    """The call's status code and details."""
    with pytest.raises(grpc.RpcError) as refused:
        infer(server, model, first)
    error: Any = refused.value
    return error.code(), error.details() or ""


def test_both_answer_alike_and_only_the_queued_one_refuses_bls_calls(served: Served) -> None:
    server = served.server
    second = np.arange(16, dtype=np.int32).reshape(1, 16)
    for model in ("queued", "plain"):
        answered = infer(server, model, 5)
        np.testing.assert_array_equal(answered["OUTPUT0"], 5 + second)
        np.testing.assert_array_equal(answered["OUTPUT1"], 5 - second)
    # An error the model answers is the caller's, in the same words and code on both paths.
    queued, plain = (refusal(server, model, -2) for model in ("queued", "plain"))
    assert queued == (plain[0], plain[1].replace("'plain'", "'queued'"))
    assert "told to fail" in queued[1]
    # A BLS call: served for the plain model, refused (naming the fix) for the queued one.
    np.testing.assert_array_equal(infer(server, "plain", -1)["OUTPUT0"], -1 + second)
    _, refused = refusal(server, "queued", -1)
    assert "cannot make BLS calls" in refused
    assert "python_instance_queues" in refused
    assert infer(server, "queued", 3)["OUTPUT0"].tolist() == (3 + second).tolist()


def test_with_front_ends_the_queued_model_is_served_with_the_parent_stopped(
    served: Served,
) -> None:
    if served.frontends == 1:
        pytest.skip("one process: it holds every call")
    server = served.server
    infer(server, "queued", 1)  # each front-end's queues attached to the worker
    with paused(server.process.pid):
        for value in range(8):
            answered = infer(server, "queued", value)
            assert answered["OUTPUT0"].tolist() == [[value + i for i in range(16)]]


def test_a_model_that_says_nothing_takes_the_queues_unless_its_code_names_a_bls_call(
    served: Served,
) -> None:
    """Where the config says nothing, the server reads the model's code: `simple` takes
    the queues (with front-ends, served with the parent stopped), `plain`, whose model.py
    names pb_utils.InferenceRequest, does not, and its BLS calls are served."""
    server = served.server
    log = server.log_text()
    assert (
        "model 'simple' version 1 takes its requests through its instances' queues, "
        "where it cannot make BLS calls: no file of its code names pb_utils.InferenceRequest"
    ) in log
    assert (
        "model 'plain' version 1 takes its requests through the server's batcher, not its "
        "instances' queues, as it may make BLS calls: 1/model.py names "
        "pb_utils.InferenceRequest (BLS calls)"
    ) in log
    second = np.arange(16, dtype=np.int32).reshape(1, 16)
    np.testing.assert_array_equal(infer(server, "plain", -1)["OUTPUT0"], -1 + second)
    np.testing.assert_array_equal(infer(server, "simple", 7)["OUTPUT1"], 7 - second)
    if served.frontends > 1:
        with paused(server.process.pid):
            for value in range(4):
                answered = infer(server, "simple", value)
                np.testing.assert_array_equal(answered["OUTPUT0"], value + second)


def upper(server: ServerProcess, words: list[bytes]) -> tuple[list[bytes], list[int]]:
    text = np.array([[w] for w in words], dtype=object)
    answer = parse_response(
        server.stub.ModelInfer(build_request("upper", {"text": text}), timeout=TIMEOUT_S)
    )
    return [v for (v,) in answer["upper"].tolist()], [n for (n,) in answer["length"].tolist()]


def test_bytes_tensors_go_through_the_queues_and_a_batch_of_them_is_split_right(
    served: Served,
) -> None:
    """Requests held while the worker is stopped meet in one batch: each gets its own
    elements of the BYTES output back (and of the other), whatever their lengths."""
    server = served.server
    assert upper(server, [b"warm", b"up"]) == ([b"WARM", b"UP"], [4, 2])
    calls = [[b"a"], [b"bb", b""], [b"\xc3\xa9t\xc3\xa9"], [b"d" * 300, b"e", b"ff"]]
    worker = only_instance(server, "upper").pid
    with ThreadPoolExecutor(len(calls)) as pool:
        with paused(worker):
            answers = [pool.submit(upper, server, words) for words in calls]
            wait_arrived(server, "upper", len(calls))
        got = [answer.result() for answer in answers]
    assert got == [
        ([w.decode().upper().encode() for w in words], [len(w.decode()) for w in words])
        for words in calls
    ]
    assert "model upper: batch of 7" in server.log_text()  # the four requests' rows together
    if served.frontends > 1:
        with paused(server.process.pid):
            assert upper(server, [b"held"]) == ([b"HELD"], [4])


def test_a_model_the_queues_cannot_take_is_served_as_before_and_the_log_says_why(
    served: Served,
) -> None:
    said = [
        line
        for line in served.server.log_text().splitlines()
        if "model 'decoupled'" in line and "python_instance_queues" in line
    ]
    assert len(said) == 1 and "no sequence or decoupled model" in said[0]


def test_a_killed_worker_comes_back_on_its_queues(served: Served) -> None:
    """SIGKILL the queued model's worker: its restart is told of its queues again (with
    front-ends, each one's through the worker's BLS link, which wakes its loop), and calls
    go on; with front-ends, served with the parent held still once it is back."""
    server = served.server
    before = only_instance(server, "queued")
    os.kill(before.pid, signal.SIGKILL)
    after = wait_for(
        "the worker's restart",
        lambda: next(
            (i for i in server.instances("queued") if i.state == "READY" and i.pid != before.pid),
            None,
        ),
    )
    assert after.restarts == before.restarts + 1
    assert infer(server, "queued", 2)["OUTPUT1"].tolist() == [[2 - i for i in range(16)]]
    if served.frontends > 1:
        with paused(server.process.pid):
            assert infer(server, "queued", 4)["OUTPUT0"].tolist() == [[4 + i for i in range(16)]]


def test_each_process_logs_the_requests_it_held_in_a_worker_that_died(served: Served) -> None:
    """A request held in the worker when it is SIGKILLed goes again and is answered; the
    line that says how many requests the worker held is written by the process that held
    them (with front-ends, the one holding the call; the parent's own line counts none)."""
    server = served.server
    infer(server, "simple", 0)  # this connection's process attached to the worker
    worker = only_instance(server, "simple").pid
    with ThreadPoolExecutor(1) as pool:
        with paused(worker):
            held = pool.submit(infer, server, "simple", 9)
            wait_arrived(server, "simple", 1)
            os.kill(worker, signal.SIGKILL)
        second = np.arange(16, dtype=np.int32).reshape(1, 16)
        np.testing.assert_array_equal(held.result()["OUTPUT0"], 9 + second)
    died = f"(pid {worker}) was killed by signal 9; "
    lines = [line for line in server.log_text().splitlines() if died in line]
    counted = [line for line in lines if "1 request(s) in it go back to the queue" in line]
    assert len(counted) == 1
    assert ("held by this front-end" in counted[0]) == (served.frontends > 1)
    if served.frontends > 1:
        assert any("0 request(s) in it go back to the queue; restarting" in x for x in lines)
