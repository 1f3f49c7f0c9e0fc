"""Paddle workers forked from the preloaded launcher (service/workers/preloaded.py): they answer
as workers started afresh do, the launcher refuses to fork once it has a second thread, and
when it dies its workers are started again through a new one, their requests answered."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from clients.inference_client import build_request
from scripts.bench_density import RESULTS
from service.workers import preloaded
from tests.e2e.test_watchdog import POISON, add_mlp_copy, parameter
from tests.reference import assert_matches_reference, example_inputs
from tests.servers import (
    REPO_ROOT,
    ServerProcess,
    alive,
    eventually,
    model_repository,
    paused,
    running_server,
    wait_arrived,
)

pytestmark = pytest.mark.e2e

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("preloaded")
    repository = model_repository(root / "models", ["mlp", "resnet18"])
    with running_server(repository, root / "server.log", ["--no-h3"]) as process:
        yield process


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def command_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def launcher_of(server: ServerProcess, model: str) -> int:
    """The preloaded launcher a model's worker was forked from (worker <- its subreaper <-
    the launcher)."""
    (instance,) = server.instances(model)
    launcher = parent_of(parent_of(instance.pid))
    assert "service.workers.preloaded" in command_of(launcher)
    return launcher


def infer_matches(server: ServerProcess, model: str, seed: int) -> None:
    inputs = example_inputs(model, seed=seed)
    response = server.stub.ModelInfer(build_request(model, inputs), timeout=TIMEOUT_S)
    assert_matches_reference(model, inputs, response)


def test_paddle_workers_are_forked_from_one_launcher_and_answer_as_fresh_ones(
    server: ServerProcess,
) -> None:
    """Both models' workers come from the same launcher, a child of the server, answer what
    Paddle in this process answers, and are named for their instance."""
    launcher = launcher_of(server, "mlp")
    assert launcher_of(server, "resnet18") == launcher
    assert parent_of(launcher) == server.process.pid
    for model in ("mlp", "resnet18"):
        infer_matches(server, model, seed=7)
        (instance,) = server.instances(model)  # ps names both processes for the instance
        assert command_of(instance.pid).rstrip("\0 ") == f"paddlequic worker {instance.name}"
        named = command_of(parent_of(instance.pid)).rstrip("\0 ")
        assert named == f"paddlequic launcher {instance.name}"


def test_a_launcher_that_dies_is_started_again_and_its_workers_with_it(
    server: ServerProcess,
) -> None:
    launcher = launcher_of(server, "mlp")
    before = {model: server.instances(model)[0] for model in ("mlp", "resnet18")}
    os.kill(launcher, signal.SIGKILL)
    for model, instance in before.items():
        ended = functools.partial(lambda pid: not alive(pid), instance.pid)
        eventually(ended, f"{model}'s worker ended with its launcher")
        infer_matches(server, model, seed=8)  # waits for the restart, as any request does
        (after,) = server.instances(model)
        assert after.restarts == instance.restarts + 1
        assert launcher_of(server, model) not in (launcher, server.process.pid)
    assert "the preloaded launcher of Paddle workers ended" in server.log_text()


def test_a_death_the_launcher_caused_is_not_counted_against_the_request(tmp_path: Path) -> None:
    """A request a worker held when the preloaded launcher died goes back to the queue
    uncharged: the server ended that worker, the request did not. The request here is also
    poison (the worker aborts on it): it is refused after two deaths of its own, three deaths
    in all; charged for the launcher's too, it was refused after two."""
    models = tmp_path / "models"
    add_mlp_copy(models, "mlp", parameter("testing_crash_on", str(POISON)))
    with running_server(models, tmp_path / "log", ["--testing-service", "--no-h3"]) as server:
        (instance,) = server.instances("mlp")
        launcher = launcher_of(server, "mlp")
        inputs = example_inputs("mlp", seed=3)
        next(iter(inputs.values())).flat[0] = POISON
        with paused(instance.pid):
            call = server.stub.ModelInfer.future(build_request("mlp", inputs), timeout=120)
            wait_arrived(server, "mlp", 1)
            os.kill(launcher, signal.SIGKILL)
            eventually(lambda: not alive(instance.pid), "the worker ended with its launcher")
        with pytest.raises(grpc.RpcError) as refused:
            call.result()
        assert "suspected poison input" in (refused.value.details() or "")
        eventually(lambda: server.instances("mlp")[0].restarts == 3, "a third restart")
        assert "ended with the preloaded launcher; 1 request(s) in it go back" in (
            server.log_text()
        )


@pytest.mark.parametrize("name", ["the preloaded launcher", "the model template"])
def test_the_launcher_refuses_to_fork_while_it_has_a_second_thread(name: str) -> None:
    """Its loop (a model template's too, template.py) run here, in a test process with a
    second thread (the loop's own): a spawn request is refused, naming why, and nothing is
    forked."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    wakeup, _ = socket.socketpair()
    loop = threading.Thread(target=preloaded.serve, args=(theirs, wakeup, (), name), daemon=True)
    loop.start()
    spare = socket.socketpair()
    try:
        request = json.dumps({"argv": [], "env": {}}).encode()
        socket.send_fds(ours, [request], [s.fileno() for s in spare])
        reply = json.loads(ours.recv(4096))
        assert re.fullmatch(rf"{name} runs \d+ threads; .*", reply["refused"])
    finally:
        ours.close()
        loop.join(timeout=TIMEOUT_S)
        theirs.close()
        wakeup.close()
        for end in spare:
            end.close()
    assert not loop.is_alive()


def test_bench_density_measures_both_launchers_and_every_copy_answers(tmp_path: Path) -> None:
    """`make bench-density` at its smallest: two copies of mlp served each way, and resnet18
    with two instances with and without a model template; a worker forked from the preloaded
    launcher holds less memory of its own than one started afresh, and one forked from a
    template less than one that built its own predictor; three copies of mlp within a budget
    that holds one are each loaded by their call, two evicted."""
    command = ["--sizes", "2", "--no-examples", "--instances", "2"]
    command += ["--budget-copies", "3", "--budget", "30"]  # room for one copy of mlp
    done = subprocess.run(
        [sys.executable, "-m", "scripts.bench_density", *command],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads((tmp_path / RESULTS).read_text())
    rows = {(r["repository"], r["launcher"]): r for r in written if "repository" in r}
    (budget,) = [r for r in written if "budget_mb" in r]
    assert (budget["answered"], budget["loads"], budget["resident"]) == (3, 3, 1)
    assert budget["evictions"] == 2
    mlp = {launcher: r for (repo, launcher), r in rows.items() if repo == "mlp x 2"}
    assert {r["answered"] for r in mlp.values()} == {2}
    assert mlp["preloaded"]["median_worker_uss_mb"] < mlp["fresh"]["median_worker_uss_mb"]
    resnet = {launcher: r for (repo, launcher), r in rows.items() if repo == "resnet18 x 2"}
    assert {(r["workers"], r["answered"]) for r in resnet.values()} == {(2, 1)}
    uss = {launcher: r["median_worker_uss_mb"] for launcher, r in resnet.items()}
    assert uss["template"] < uss["preloaded"]
