"""A Python model attacking the front-end through its worker (tests/fixtures/python_hostile),
on a real server beside a Paddle model and another Python model:

- a header declaring 1 GiB on its own worker socket is refused before the body is read: the
  server's memory does not grow by it, the call fails with INTERNAL naming the breach, the
  worker is killed and counted, and the request is not run again on the restarted worker;
- a flood of printed lines (at load and on a request) reaches the log only within the model's
  budget; the rest are counted and dropped, and the other models answer throughout."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from service.workers.model_output import BURST_S
from tests.e2e.test_python_model import infer
from tests.servers import ServerProcess, eventually, model_repository, running_server

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TIMEOUT_S = 60.0
DECLARED = 1 << 30  # what the hostile model's header declares
MiB = 1 << 20
LOAD_FLOOD = 50_000  # empty lines, and as many lines of text, printed at load
CALL_FLOOD = 50_000  # the same again, on a request
LINES_PER_S = 20.0  # --model-output-lines
MAX_MESSAGE = 1 << 20  # --max-message-bytes: what one caller may receive
BYTES_PER_S = 4096.0  # --model-output-bytes


@dataclass
class Hostile:
    server: ServerProcess
    started: float  # time.monotonic() before the server started


def hostile_model(
    repository: Path, name: str, flood_at_load: int = 0, oversized_at_load: bool = False
) -> None:
    source = FIXTURES / "python_hostile"
    shutil.copytree(source, repository / name)
    config = (source / "config.pbtxt").read_text().replace('name: "hostile"', f'name: "{name}"')
    config = config.replace(
        'key: "flood_at_load" value: { string_value: "0" }',
        f'key: "flood_at_load" value: {{ string_value: "{flood_at_load}" }}',
    )
    if oversized_at_load:
        config = config.replace(
            'key: "oversized_at_load" value: { string_value: "0" }',
            'key: "oversized_at_load" value: { string_value: "1" }',
        )
    (repository / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    root = tmp_path_factory.mktemp("hostile")
    repository = model_repository(root / "models", ["mlp"])
    hostile_model(repository, "oversized")
    hostile_model(repository, "flooder", flood_at_load=LOAD_FLOOD)
    hostile_model(repository, "loadbreaker", oversized_at_load=True)
    shutil.copytree(FIXTURES / "python_model", repository / "upper" / "1")
    shutil.move(repository / "upper" / "1" / "config.pbtxt", repository / "upper")
    args = [
        *("--certs-dir", str(root / "certs")),
        *("--model-output-lines", str(LINES_PER_S)),
        *("--model-output-bytes", str(BYTES_PER_S)),
        *("--max-message-bytes", str(MAX_MESSAGE)),
    ]
    started = time.monotonic()
    with running_server(repository, root / "server.log", args, wait=False) as server:
        server.wait_loaded()
        yield Hostile(server, started)


def act(server: ServerProcess, model: str, action: str) -> str:
    text = np.array([action.encode()], dtype=np.object_)
    response = server.stub.ModelInfer(build_request(model, {"action": text}), timeout=TIMEOUT_S)
    (done,) = parse_response(response)["done"].tolist()
    return bytes(done).decode()


def counter(server: ServerProcess, name: str, model: str) -> float:
    found = [s.value for s in server.metrics() if s.name == name and s.labels["model"] == model]
    return found[0] if found else 0.0


def peak_rss(pid: int) -> int:
    """The process's resident-memory high-water mark, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        (line,) = [x for x in status if x.startswith("VmHWM:")]
    return int(line.split()[1]) * 1024


def others_answer(server: ServerProcess) -> None:
    assert infer(server, "still")["upper"].tolist() == [[b"STILL"]]
    mlp = build_request("mlp", {"input": np.ones((1, 256), np.float32)})
    assert parse_response(server.stub.ModelInfer(mlp, timeout=TIMEOUT_S))["probabilities"].size


def test_an_oversized_worker_message_is_refused_at_its_header(hostile: Hostile) -> None:
    server = hostile.server
    others_answer(server)
    before = peak_rss(server.process.pid)
    with pytest.raises(grpc.RpcError) as refused:
        act(server, "oversized", "oversized")
    assert refused.value.code() is grpc.StatusCode.INTERNAL
    details = refused.value.details() or ""
    assert f"broke the worker protocol (sent a message of {DECLARED} bytes, more than" in details
    assert "the request is not run again" in details
    # Only the header was read: nothing near the declared size was ever held.
    assert peak_rss(server.process.pid) - before < DECLARED // 8
    assert counter(server, "paddlequic_worker_protocol_breaches_total", "oversized") == 1
    assert "broke the protocol (Oversized(" in server.log_text()
    others_answer(server)
    # The restarted worker never ran the refused request: this is its first.
    eventually(lambda: act_or_none(server) is not None, "the restarted worker answers")
    assert act(server, "oversized", "count") == "ok 2"
    assert counter(server, "paddlequic_worker_protocol_breaches_total", "oversized") == 1


def test_a_legitimate_answer_is_bounded_by_what_its_caller_may_receive(hostile: Hostile) -> None:
    """The bound never kills a worker for an answer its caller could receive (the first of a
    size travels inline, the shared memory not grown yet); a larger one the worker fails
    itself with RESOURCE_EXHAUSTED naming the limit (as the response over
    --max-message-bytes was refused before), and goes on serving."""
    server = hostile.server
    (instance,) = server.instances("oversized")
    breaches = counter(server, "paddlequic_worker_protocol_breaches_total", "oversized")
    just_fits = MAX_MESSAGE - 64  # BYTES framing and the response's own fields
    assert act(server, "oversized", f"big:{just_fits}") == "x" * just_fits
    with pytest.raises(grpc.RpcError) as refused:
        act(server, "oversized", f"big:{2 * MAX_MESSAGE}")
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"more than the {MAX_MESSAGE} this batch's callers may receive" in (
        refused.value.details() or ""
    )
    assert act(server, "oversized", "count").startswith("ok ")
    assert [i.pid for i in server.instances("oversized")] == [instance.pid]
    assert counter(server, "paddlequic_worker_protocol_breaches_total", "oversized") == breaches


def test_an_oversized_message_in_place_of_the_load_answer_fails_the_load(
    hostile: Hostile,
) -> None:
    """Before the load is answered only a descriptor may come (64 KiB)."""
    server = hostile.server
    index = server.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10).models
    (version,) = [m for m in index if m.name == "loadbreaker"]
    assert version.state == "UNAVAILABLE"
    assert f"sent a message of {DECLARED} bytes, more than the {64 << 10}" in version.reason
    others_answer(server)


def act_or_none(server: ServerProcess) -> str | None:
    try:
        return act(server, "oversized", "count")
    except grpc.RpcError:
        return None


def test_a_model_output_flood_stays_within_its_budget(hostile: Hostile) -> None:
    server = hostile.server
    answered: list[bytes] = []
    failed: list[BaseException] = []
    flooding = threading.Event()

    def neighbour() -> None:
        while not flooding.is_set():
            try:
                answered.append(infer(server, "neighbour")["upper"].tolist()[0][0])
            except BaseException as exc:
                failed.append(exc)
                return

    thread = threading.Thread(target=neighbour)
    thread.start()
    try:
        assert act(server, "flooder", f"flood:{CALL_FLOOD}").startswith("ok ")
    finally:
        flooding.set()
        thread.join()
    assert not failed
    assert answered and set(answered) == {b"NEIGHBOUR"}
    others_answer(server)
    printed = 2 * (LOAD_FLOOD + CALL_FLOOD)

    def logged() -> list[str]:
        return [
            o["message"]
            for o in server.log_objects()
            if o.get("logger") == "paddlequic.model" and o["message"].startswith("model flooder:")
        ]

    def dropped() -> float:
        return counter(server, "paddlequic_model_output_dropped_lines_total", "flooder")

    # Every line printed is either logged or counted as dropped (the reader may still be on
    # its way through the flood).
    def accounted() -> bool:
        lines = [m for m in logged() if "of its output dropped" not in m]
        return len(lines) + dropped() >= printed

    eventually(accounted, "every printed line logged or counted")
    elapsed = time.monotonic() - hostile.started
    reports = [m for m in logged() if "of its output dropped" in m]
    lines = [m for m in logged() if "of its output dropped" not in m]
    # The budget: BURST_S seconds' worth at once, then its rate, in lines and in bytes.
    assert len(lines) <= LINES_PER_S * (BURST_S + elapsed)
    assert sum(len(m) + 1 for m in lines) <= BYTES_PER_S * (BURST_S + elapsed) + 64 * len(lines)
    assert dropped() >= printed - len(lines)
    # One line says how many were dropped before each line logged after a drop.
    assert 1 <= len(reports) <= len(lines) + 1
    assert "over its budget of 20 lines and 4096 bytes per second" in reports[0]
