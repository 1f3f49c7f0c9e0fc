"""Instances of one Paddle CPU model version forked from one model template (service/workers/
template.py), which built the predictor they share: they answer as in-process Paddle does, a
worker that dies restarts through the template, and a template that dies takes its instances
with it, which restart through a new one, their requests answered and none blamed."""

from __future__ import annotations

import functools
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from service.workers.fork_channel import MAX_REQUEST_BYTES
from service.workers.memory import private_bytes
from tests.e2e.test_preloaded_launcher import command_of, infer_matches, launcher_of, parent_of
from tests.reference import assert_matches_reference, example_inputs
from tests.servers import (
    EXAMPLE_MODELS,
    ServerProcess,
    alive,
    eventually,
    model_repository,
    paused,
    running_server,
    wait_arrived,
)

pytestmark = pytest.mark.e2e

TIMEOUT_S = 120.0
PAIR = "mlp"  # the example's program, two instances


def add_pair(models: Path, name: str, example: str = "mlp") -> Path:
    """An example model named `name`, with two instances; its version directory returned."""
    pair = models / name
    (pair / "1").mkdir(parents=True)
    for weights in (EXAMPLE_MODELS / example / "1").iterdir():
        (pair / "1" / weights.name).symlink_to(weights)
    config = (EXAMPLE_MODELS / example / "config.pbtxt").read_text()
    config = config.replace(f'name: "{example}"', f'name: "{name}"')
    (pair / "config.pbtxt").write_text(config.replace("count: 1", "count: 2"))
    return pair / "1"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("templates")
    models = model_repository(root / "models", ["resnet18"])  # one instance: no template
    add_pair(models, PAIR)
    with running_server(models, root / "server.log", ["--no-h3"]) as process:
        yield process


def template_of(pid: int) -> int:
    """The model template a worker was forked from (worker <- its launcher <- the template)."""
    template = parent_of(parent_of(pid))
    assert command_of(template).rstrip("\0 ") == f"paddlequic model-template {PAIR}"
    return template


def pids(server: ServerProcess) -> list[int]:
    instances = server.instances(PAIR)
    assert len(instances) == 2
    return [i.pid for i in instances]


def ready(server: ServerProcess, restarts: int) -> bool:
    """Both instances READY, restarted `restarts` times in all."""
    instances = server.instances(PAIR)
    return all(i.state == "READY" for i in instances) and (
        sum(i.restarts for i in instances) == restarts
    )


def holds(server: ServerProcess, pid: int) -> bool:
    return any(i.pid == pid and i.outstanding for i in server.instances(PAIR))


def both_answer(server: ServerProcess, seed: int) -> None:
    """Each worker answers what Paddle in this process answers: calls are made until one held
    still holds one, then the next goes to the other worker (a call goes to the instance with
    less outstanding work), and the first answers once it runs again."""
    first, _ = pids(server)
    calls: list[tuple[dict[str, Any], Any]] = []
    with paused(first):
        while not holds(server, first):
            inputs = example_inputs(PAIR, seed=seed + len(calls))
            call = server.stub.ModelInfer.future(build_request(PAIR, inputs), timeout=TIMEOUT_S)
            calls.append((inputs, call))
            settled = functools.partial(lambda c: c.done() or holds(server, first), call)
            eventually(settled, "answered or held")
        infer_matches(server, PAIR, seed=seed + 100)  # by the other worker
    for inputs, call in calls:
        assert_matches_reference(PAIR, inputs, call.result())


def test_instances_are_forked_from_one_template_and_answer_as_paddle(
    server: ServerProcess,
) -> None:
    first, second = pids(server)
    template = template_of(first)
    assert template_of(second) == template
    # The template is a child of the preloaded launcher; a one-instance model has none.
    assert "service.workers.preloaded" in command_of(parent_of(template))
    assert parent_of(template) == launcher_of(server, "resnet18")
    both_answer(server, seed=11)


def test_a_killed_worker_restarts_through_the_same_template(server: ServerProcess) -> None:
    restarts = sum(i.restarts for i in server.instances(PAIR))
    first, second = pids(server)
    template = template_of(first)
    os.kill(first, signal.SIGKILL)
    eventually(lambda: ready(server, restarts + 1), "the worker restarted")
    restarted = next(p for p in pids(server) if p != second)
    assert template_of(restarted) == template
    both_answer(server, seed=12)


def test_a_killed_template_restarts_both_instances_and_loses_no_request(
    server: ServerProcess,
) -> None:
    """Requests the workers held when their template died go back to the queue, unblamed, and
    are answered by the instances started through a new template."""
    before = {i.name: i.restarts for i in server.instances(PAIR)}
    first, second = pids(server)
    template = template_of(first)
    inputs = [example_inputs(PAIR, seed=20 + n) for n in range(4)]
    with paused(first), paused(second):
        calls = [
            server.stub.ModelInfer.future(build_request(PAIR, i), timeout=TIMEOUT_S) for i in inputs
        ]
        wait_arrived(server, PAIR, len(calls))
        os.kill(template, signal.SIGKILL)
        for pid in (first, second):
            eventually(functools.partial(lambda p: not alive(p), pid), "the worker ended")
    for call, sent in zip(calls, inputs, strict=True):
        assert_matches_reference(PAIR, sent, call.result())
    eventually(lambda: ready(server, sum(before.values()) + 2), "both instances restarted")
    assert {i.name: i.restarts - 1 for i in server.instances(PAIR)} == before
    renewed = template_of(pids(server)[0])
    assert renewed != template and template_of(pids(server)[1]) == renewed
    assert "ended with its model template" in server.log_text()
    assert "suspected poison" not in server.log_text()
    both_answer(server, seed=13)


def test_a_template_whose_model_fails_to_build_leaves_the_workers_to_report_it(
    tmp_path: Path,
) -> None:
    """Its failure (weights that are not Paddle's) is answered, not waited for: each instance
    starts without a template, fails to load as it always did and says why, and another
    model's template still serves its instances."""
    models = tmp_path / "models"
    add_pair(models, PAIR)
    weights = add_pair(models, "broken") / "inference.pdiparams"
    weights.unlink()
    weights.write_bytes(b"not Paddle's weights" * 100)
    with running_server(models, tmp_path / "log", ["--no-h3"], wait=False) as server:
        server.wait_loaded()
        index = {m.name: m for m in server.stub.RepositoryIndex(pb.RepositoryIndexRequest()).models}
        assert index["broken"].state == "UNAVAILABLE"
        assert index["broken"].reason
        warning = re.search(r"'broken''s workers without a model template: (.+)", server.log_text())
        assert warning is not None
        assert index[PAIR].state == "READY"
        first, second = pids(server)
        assert template_of(first) == template_of(second)
        infer_matches(server, PAIR, seed=14)


def test_a_reload_forks_from_a_new_template_and_an_unload_ends_it(tmp_path: Path) -> None:
    """A reload whose config changed (three instances) starts a template for the new Load; the
    old one ends with the old instances, and the new one with the last instance unloaded."""
    models = tmp_path / "models"
    add_pair(models, PAIR)
    args = ["--model-control-mode", "explicit", "--load-model", PAIR, "--no-h3"]
    with running_server(models, tmp_path / "log", args) as server:
        old = template_of(pids(server)[0])
        config = models / PAIR / "config.pbtxt"
        config.write_text(config.read_text().replace("count: 2", "count: 3"))
        server.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=PAIR))
        eventually(lambda: len(server.instances(PAIR)) == 3, "three instances serve")
        eventually(functools.partial(lambda p: not alive(p), old), "the old template ended")
        templates = {template_of(i.pid) for i in server.instances(PAIR)}
        assert len(templates) == 1 and old not in templates
        infer_matches(server, PAIR, seed=15)
        server.stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=PAIR))
        (new,) = templates
        eventually(functools.partial(lambda p: not alive(p), new), "the template ended")


def test_the_memory_budget_counts_the_model_its_template_holds(tmp_path: Path) -> None:
    """Under --model-memory-budget a model's size is what unloading it gives back: with a
    template, its workers' private memory and the model the template built, which is in none
    of their private memory (resnet18's weights: 45 MB)."""
    models = tmp_path / "models"
    weights = add_pair(models, "resnet18", "resnet18") / "inference.pdiparams"
    args = ["--no-h3", "--model-memory-budget", "100000", "--model-control-mode", "explicit"]
    args += ["--load-model", "resnet18"]
    with running_server(models, tmp_path / "log", args) as server:
        instances = server.instances("resnet18")
        templates = {parent_of(parent_of(i.pid)) for i in instances}
        assert len(templates) == 1  # both forked from one template
        workers = sum(private_bytes(parent_of(i.pid)) for i in instances)
        sizes = [
            s.value
            for s in server.metrics()
            if s.name == "paddlequic_model_memory_bytes" and s.labels.get("model") == "resnet18"
        ]
        assert sizes and sizes[0] >= workers + 0.9 * weights.stat().st_size


def test_a_load_larger_than_a_template_request_starts_its_instances_without_one(
    tmp_path: Path,
) -> None:
    """A Load past MAX_REQUEST_BYTES (a config with a large parameter) is not sent to a
    template: the instances start as without one, named in the log, and answer."""
    models = tmp_path / "models"
    config = add_pair(models, PAIR).parent / "config.pbtxt"
    large = "x" * MAX_REQUEST_BYTES
    config.write_text(
        config.read_text() + f'parameters {{ key: "note" value: {{ string_value: "{large}" }} }}\n'
    )
    with running_server(models, tmp_path / "log", ["--no-h3"]) as server:
        assert re.search(
            r"without a model template: its Load takes \d+ bytes, more than", server.log_text()
        )
        for pid in pids(server):
            assert "service.workers.preloaded" in command_of(parent_of(parent_of(pid)))
        infer_matches(server, PAIR, seed=16)
