"""A worker process that dies mid-request: its request runs again in the restarted worker,
everything else goes on, and the instance comes back.

Starts its own server: killing workers of the shared one would disturb other tests.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from clients.inference_client import build_request
from protos.paddlequic.v1 import control_pb2
from tests.reference import assert_matches_reference, example_inputs
from tests.servers import ServerProcess, model_repository, running_server

_T = TypeVar("_T")
POLL_LIMIT_S = 120.0  # generous: a restart loads ResNet-18 again on a busy 2-core machine
RPC_TIMEOUT_S = 150.0  # longer than the server's own bounded wait for a restarting worker


def wait_for(what: str, probe: Callable[[], _T | None], limit_s: float = POLL_LIMIT_S) -> _T:
    """Poll until probe() returns something (bounded), instead of guessing a sleep."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        found = probe()
        if found is not None:
            return found
        time.sleep(0.02)
    raise AssertionError(f"gave up after {limit_s:.0f} s waiting for {what}")


def only_instance(server: ServerProcess, model: str) -> control_pb2.Instance:
    (instance,) = server.instances(model)
    return instance


def test_killed_worker_comes_back_and_its_request_runs_again(tmp_path: Path) -> None:
    repository = model_repository(tmp_path / "models", ["mlp", "resnet18"])
    with running_server(repository, tmp_path / "server.log") as server:
        check_kill_and_restart(server)


def check_kill_and_restart(server: ServerProcess) -> None:
    """SIGKILL the resnet18 worker with a request inside it, then watch the server recover."""
    before = only_instance(server, "resnet18")
    assert (before.state, before.restarts, before.outstanding) == ("READY", 0, 0)
    assert before.pid > 0
    slow_inputs = {"image": np.random.default_rng(1).standard_normal((16, 3, 224, 224), np.float32)}

    # Stop the worker before sending, so the request is certainly still inside it when it is
    # killed (a running worker could finish it between our look and the kill).
    os.kill(before.pid, signal.SIGSTOP)
    slow = server.stub.ModelInfer.future(
        build_request("resnet18", slow_inputs), timeout=RPC_TIMEOUT_S
    )
    wait_for(
        "the resnet18 request to reach its worker",
        lambda: True if only_instance(server, "resnet18").outstanding >= 1 else None,
    )
    os.kill(before.pid, signal.SIGKILL)
    follower_inputs = example_inputs("resnet18", seed=5)
    follower = server.stub.ModelInfer.future(
        build_request("resnet18", follower_inputs), timeout=RPC_TIMEOUT_S
    )

    # Once the front-end has seen the death, other models keep answering meanwhile.
    wait_for(
        "the front-end to notice the dead worker",
        lambda: True if only_instance(server, "resnet18").state != "READY" else None,
    )
    # A resnet18 request sent while the instance restarts waits for it.
    waiter_inputs = example_inputs("resnet18", seed=6)
    waiter = server.stub.ModelInfer.future(
        build_request("resnet18", waiter_inputs), timeout=RPC_TIMEOUT_S
    )
    mlp_inputs = example_inputs("mlp", seed=11)
    mlp = server.stub.ModelInfer(build_request("mlp", mlp_inputs), timeout=RPC_TIMEOUT_S)
    assert_matches_reference("mlp", mlp_inputs, mlp)
    assert server.process.poll() is None, "the server process died with its worker"

    after = wait_for(
        "the resnet18 instance to be restarted",
        lambda: (
            i
            if (i := only_instance(server, "resnet18")).state == "READY" and i.pid != before.pid
            else None
        ),
    )
    assert after.restarts == 1

    # The request the killed worker held ran again in the new one (inference has no side
    # effects); the one sent before the restart finished waited for it.
    assert_matches_reference("resnet18", slow_inputs, slow.result(timeout=RPC_TIMEOUT_S))
    assert_matches_reference("resnet18", follower_inputs, follower.result(timeout=RPC_TIMEOUT_S))

    assert_matches_reference("resnet18", waiter_inputs, waiter.result(timeout=RPC_TIMEOUT_S))
    for seed in (21, 22):
        inputs = example_inputs("resnet18", seed=seed)
        response = server.stub.ModelInfer(build_request("resnet18", inputs), timeout=RPC_TIMEOUT_S)
        assert_matches_reference("resnet18", inputs, response)
    big = server.stub.ModelInfer(build_request("resnet18", slow_inputs), timeout=RPC_TIMEOUT_S)
    assert_matches_reference("resnet18", slow_inputs, big)
    final = only_instance(server, "resnet18")
    assert (final.pid, final.restarts, final.outstanding) == (after.pid, 1, 0)
    assert only_instance(server, "mlp").restarts == 0
    log = server.log_text()
    assert f"(pid {before.pid}) was killed by signal 9;" in log
    assert "request(s) in it go back to the queue" in log
    assert f"restarted (pid {after.pid})" in log


@pytest.mark.parametrize("frontends", [1, 2])
def test_a_worker_killed_after_serving_comes_back_at_once_each_time(
    tmp_path: Path, frontends: int
) -> None:
    """On the instance queues a worker's answers never cross its socket; one killed after it
    served is still no crash loop: each death, however soon after the last, restarts at once
    (restarts.py), whichever process held the calls (the parent reads every batch's number
    in its own running area). Once, deaths 1, 2 and 4 s apart here grew the wait to 30 s."""
    repository = model_repository(tmp_path / "models", ["mlp"])
    args = ["--frontends", str(frontends)]
    with running_server(repository, tmp_path / "server.log", args) as server:
        killed: list[int] = []
        for seed in range(3):
            pid = wait_for(
                "mlp to serve from a new worker",
                lambda: (
                    i.pid
                    if (i := only_instance(server, "mlp")).state == "READY" and i.pid not in killed
                    else None
                ),
            )
            inputs = example_inputs("mlp", seed=seed)
            answer = server.stub.ModelInfer(build_request("mlp", inputs), timeout=RPC_TIMEOUT_S)
            assert_matches_reference("mlp", inputs, answer)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            wait_for("the death in the log", lambda: _death_logged(server, killed[-1]))
        log = server.log_text()
        for pid in killed:
            (line,) = [line for line in log.splitlines() if f"(pid {pid}) was killed" in line]
            assert "restarting in 0.0 s" in line, line


def _death_logged(server: ServerProcess, pid: int) -> bool | None:
    return True if f"(pid {pid}) was killed by signal 9" in server.log_text() else None
