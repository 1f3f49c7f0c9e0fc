"""What a Triton Python model is given and what reaches its callers, on a real server with the
models of tests/fixtures/python_api: initialize()'s `args` as Triton builds them (the config
JSON with its 64-bit integers as numbers, so a model that checks `dims == [1]` loads), a
failure's whole message, and a warm-up only where config.pbtxt asks for one (model_warmup)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from service.backend.python_model import MAX_FAILURE_BYTES
from service.backend.python_runtime.triton_python_backend_utils import MAX_METRICS
from service.workers.bls_calls import BLS_MAX_RESPONSES
from tests.servers import ServerProcess, eventually, running_server

pytestmark = pytest.mark.e2e

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "python_api"
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("python_api")
    repository = root / "models"
    shutil.copytree(FIXTURES, repository)
    with running_server(repository, root / "server.log", wait=False) as s:
        s.wait_loaded()  # each test asks its own models: one that failed to load fails it
        yield s


def infer(
    server: ServerProcess, model: str, inputs: dict[str, np.ndarray[Any, Any]]
) -> dict[str, np.ndarray[Any, Any]]:
    request = build_request(model, inputs)
    return parse_response(server.stub.ModelInfer(request, timeout=TIMEOUT_S))


def ask(server: ServerProcess, what: str) -> str:
    text = infer(server, "args", {"what": np.array([what.encode()], dtype=np.object_)})["text"]
    return bytes(text[0]).decode()


def failure(server: ServerProcess, what: str) -> str:
    with pytest.raises(grpc.RpcError) as raised:
        ask(server, what)
    return raised.value.details() or ""


def test_initialize_is_given_the_args_triton_gives(server: ServerProcess) -> None:
    args = json.loads(ask(server, "args"))
    assert set(args) == {
        "model_config",
        "model_instance_kind",
        "model_instance_name",
        "model_instance_device_id",
        "model_repository",
        "model_version",
        "model_name",
    }
    assert (args["model_name"], args["model_version"]) == ("args", "1")
    assert (args["model_instance_kind"], args["model_instance_device_id"]) == ("CPU", "0")
    assert Path(args["model_repository"]).name == "args"
    config = json.loads(args["model_config"])
    assert config["input"] == [
        {
            "name": "what",
            "data_type": "TYPE_STRING",
            "format": "FORMAT_NONE",
            "dims": [1],
            "is_shape_tensor": False,
            "allow_ragged_batch": False,
            "optional": False,
            "is_non_linear_format_io": False,
        }
    ]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert config["max_batch_size"] == 0 and config["backend"] == "python"


def test_a_model_that_checks_its_dims_as_triton_examples_do_loads(server: ServerProcess) -> None:
    """square (Triton's decoupled example's checks): `dims == [1]`; 3 responses for IN=3."""
    request = build_request("square", {"IN": np.array([3], dtype=np.int32)})
    responses = list(server.stub.ModelStreamInfer(iter([request]), timeout=TIMEOUT_S))
    assert [r.error_message for r in responses if r.error_message] == []
    outs = [parse_response(r.infer_response).get("OUT") for r in responses]
    assert [o.tolist() for o in outs if o is not None] == [[3], [3], [3]]
    # prometheus_client's parser names a counter's samples NAME_total.
    counted = [s.value for s in server.metrics() if s.name == "square_responses_total"]
    assert counted == [3.0]  # the worker sent its updates before its final response


def test_a_failure_reaches_the_caller_whole(server: ServerProcess) -> None:
    assert "line one\nline two\nline three" in failure(server, "raise")
    assert "first line\nsecond line" in failure(server, "error")
    long = failure(server, "long")
    assert len(long.encode()) <= MAX_FAILURE_BYTES
    assert long.endswith("more bytes)") and "ValueError: xxxx" in long
    assert "pb_utils.load_model is not implemented by paddlequic" in failure(server, "load_model")
    assert ask(server, "fine") == "fine"


def test_python_models_are_warmed_by_model_warmup_only(server: ServerProcess) -> None:
    """nonzero refuses zeros and caller calls the model its input names: both are READY,
    never run with zero-filled inputs; warmed ran its model_warmup sample 3 times."""
    for model in ("nonzero", "caller", "warmed"):
        ready = server.stub.ModelReady(pb.ModelReadyRequest(name=model), timeout=5)
        assert ready.ready, model
    assert infer(server, "warmed", {"x": np.array([1], dtype=np.int32)})["runs"].tolist() == [4]
    inputs = {"model": np.array([b"nonzero"], dtype=np.object_), "x": np.array([3], np.int32)}
    got = infer(server, "caller", inputs)
    assert got["y"].tolist() == [6]


def model_records(server: ServerProcess, model: str) -> list[tuple[str, str]]:
    """(level, message) of each line the server logged of the model's output."""
    records = server.log_objects()
    prefix = f"model {model}: "
    return [
        (r["level"], r["message"].removeprefix(prefix))
        for r in records
        if r["logger"] == "paddlequic.model" and r["message"].startswith(prefix)
    ]


def test_logger_lines_reach_the_server_log_at_their_level_within_the_budget(
    server: ServerProcess,
) -> None:
    assert ask(server, "log") == "log"
    expected = [
        ("info", "an info line"),
        ("warning", "a warning"),
        ("warning", "of two lines"),
        ("error", "an error line"),
        ("error", "an error through log()"),
    ]
    # The model's output is read off the event loop: its lines may land after the answer.
    eventually(
        lambda: all(line in model_records(server, "args") for line in expected),
        "the model's log lines",
    )
    logged = model_records(server, "args")
    assert not any("verbose" in message for _, message in logged)  # DEBUG: not logged
    assert ask(server, "flood") == "flood"

    def reported() -> bool:
        """The drop is reported before the next line logged: log one, once the budget let it."""
        ask(server, "log")
        return any("of its output dropped" in m for _, m in model_records(server, "args"))

    eventually(reported, "the flood's dropped lines reported")
    assert len([m for _, m in model_records(server, "args") if m.startswith("flood")]) < 3000


def test_custom_metrics_are_exported_beside_the_servers_own(server: ServerProcess) -> None:
    """Triton's MetricFamily / Metric: a counter, a gauge and a histogram with buckets,
    labelled, on the server's metrics endpoint; a model making metrics without end is refused
    at the bound, naming it."""
    for x, seen in ((0.5, 1.0), (5.0, 2.0), (50.0, 3.0)):
        got = infer(server, "metered", {"x": np.array([x])})
        assert got["seen"].tolist() == [seen]
    labels = {"model": "metered", "version": "1"}

    def sample(name: str, **extra: str) -> float | None:
        wanted = {**labels, **extra}
        found = [s.value for s in server.metrics() if s.name == name and s.labels == wanted]
        return found[0] if found else None

    # prometheus_client's parser names a counter's samples NAME_total; they are written as
    # Triton writes them (the test below).
    eventually(lambda: sample("metered_requests_total") == 3.0, "the counter at 3")
    assert sample("metered_last_x") == 50.0
    assert [sample("metered_x_bucket", le=le) for le in ("1.0", "10.0", "+Inf")] == [1, 2, 3]
    assert (sample("metered_x_count"), sample("metered_x_sum")) == (3, 55.5)
    with pytest.raises(grpc.RpcError) as raised:
        infer(server, "metered", {"x": np.array([-1.0])})
    assert f"at most {MAX_METRICS} metrics" in (raised.value.details() or "")
    assert any(s.name.startswith("paddlequic_") for s in server.metrics())  # the server's own


def test_custom_metrics_are_written_as_triton_writes_them(server: ServerProcess) -> None:
    """A counter's HELP and TYPE lines name it as its model did (Triton's custom_metrics
    client looks for `# TYPE NAME counter`), as its samples do."""
    infer(server, "metered", {"x": np.array([2.0])})
    labels = '{model="metered",version="1"}'

    def written() -> bool:
        text = server.metrics_text()
        return all(
            line in text.splitlines()
            for line in (
                "# HELP metered_requests requests seen",
                "# TYPE metered_requests counter",
                "# TYPE metered_last_x gauge",
                "# TYPE metered_x histogram",
            )
        ) and any(line.startswith(f"metered_requests{labels} ") for line in text.splitlines())

    eventually(written, "metered's families as Triton writes them")
    assert "metered_requests_total" not in server.metrics_text()


def test_auto_complete_config_completes_a_missing_or_partial_config(server: ServerProcess) -> None:
    """`completed` has no config.pbtxt (a model.py makes it a Python model); `half_config`'s
    lists only its input. ModelConfig answers what auto_complete_config added."""
    config = server.stub.ModelConfig(pb.ModelConfigRequest(name="completed"), timeout=5).config
    assert (config.backend, config.max_batch_size) == ("python", 4)
    assert config.HasField("dynamic_batching")
    assert [(t.name, list(t.dims)) for t in config.input] == [("INPUT0", [4]), ("INPUT1", [4])]
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    got = infer(server, "completed", {"INPUT0": a, "INPUT1": np.ones_like(a)})
    assert got["OUTPUT0"].tolist() == (a + 1).tolist() and got["OUTPUT1"].shape == (2, 4)
    half = server.stub.ModelConfig(pb.ModelConfigRequest(name="half_config"), timeout=5).config
    assert [t.name for t in half.output] == ["y"]
    x = np.array([1, 2], dtype=np.int32)
    y = infer(server, "half_config", {"x": x})["y"]  # int64 answered: what INT32 holds
    assert (y.tolist(), y.dtype) == ([3, 6], np.int32)


@pytest.mark.parametrize(("how", "calls"), [("sync", 1), ("async", 2)])
def test_bls_calls_to_a_decoupled_model_answer_every_response(
    server: ServerProcess, how: str, calls: int
) -> None:
    """square answers IN=3 with 3 responses of 3 and a final empty one, per call."""
    inputs = {"n": np.array([3], dtype=np.int32), "how": np.array([how.encode()], np.object_)}
    got = infer(server, "square_caller", inputs)
    assert (got["total"].tolist(), got["responses"].tolist()) == ([9 * calls], [4 * calls])


def test_a_decoupled_bls_call_that_fails_answers_its_error(server: ServerProcess) -> None:
    """An unknown model; more responses than one call may gather (BLS_MAX_RESPONSES)."""
    inputs = {"n": np.array([1], dtype=np.int32), "how": np.array([b"nowhere"], np.object_)}
    with pytest.raises(grpc.RpcError) as raised:
        infer(server, "square_caller", inputs)
    assert "nowhere" in (raised.value.details() or "")
    inputs = {
        "n": np.array([BLS_MAX_RESPONSES], dtype=np.int32),
        "how": np.array([b"sync"], np.object_),
    }
    with pytest.raises(grpc.RpcError) as raised:
        infer(server, "square_caller", inputs)
    assert f"more than {BLS_MAX_RESPONSES} responses" in (raised.value.details() or "")
    inputs["n"] = np.array([2], dtype=np.int32)
    assert infer(server, "square_caller", inputs)["total"].tolist() == [4]


def test_a_decoupled_bls_call_hands_each_response_over_as_it_comes(server: ServerProcess) -> None:
    """`held` sends its second response only once its request is cancelled, which happens
    when square_caller's request ends: square_caller can answer only if it got the first
    response before `held` sent the last."""
    inputs = {"n": np.array([7], dtype=np.int32), "how": np.array([b"first"], np.object_)}
    got = infer(server, "square_caller", inputs)
    assert (got["total"].tolist(), got["responses"].tolist()) == ([7], [1])


def test_cancelling_a_decoupled_bls_call_cancels_the_called_models_request(
    server: ServerProcess,
) -> None:
    """ResponseIterator.cancel(): `held` ends only once its request is cancelled, so the
    caller's iterator ends, with one CANCELLED error response, only if cancel() reached it."""
    inputs = {"n": np.array([5], dtype=np.int32), "how": np.array([b"cancel"], np.object_)}
    got = infer(server, "square_caller", inputs)
    assert (got["total"].tolist(), got["responses"].tolist()) == ([5], [7])  # CANCELLED
