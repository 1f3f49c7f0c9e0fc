"""A signal to the server's whole process group (Ctrl-C's SIGINT in a terminal, `timeout`'s or
a supervisor's SIGTERM to the group) stops it as a signal to the server alone does: the
workers' launchers are in process groups of their own, so the server drains the calls its
workers hold, then ends them. Before, each launcher took the group's SIGTERM and killed its
worker at once: each death was logged as an error and restarted the worker during the stop,
its calls sent again (the launchers always ignored SIGINT: that case passed before too)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from clients.inference_client import build_request
from tests.e2e.test_worker_restart import only_instance
from tests.reference import assert_matches_reference, example_inputs
from tests.servers import (
    ServerProcess,
    alive,
    descendants,
    model_repository,
    paused,
    wait_arrived,
    wait_logged,
)

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_group_lets_the_workers_finish_their_calls(
    tmp_path: Path, sig: signal.Signals
) -> None:
    # tokenizer: a Python model, whose worker starts fresh (not from the preloaded launcher).
    repository = model_repository(tmp_path / "models", ["mlp", "tokenizer"])
    server = ServerProcess(
        repository, tmp_path / "server.log", ["--grace-period", "30"], new_session=True
    )
    try:
        server.wait_ready()
        below = descendants(server.process.pid)
        inputs = example_inputs("mlp", seed=3)
        with paused(only_instance(server, "mlp").pid):
            call = server.stub.ModelInfer.future(build_request("mlp", inputs), timeout=60)
            wait_arrived(server, "mlp", 1)
            os.killpg(server.process.pid, sig)
            wait_logged(server, "shutting down: finishing in-flight calls")
        assert_matches_reference("mlp", inputs, call.result())
        assert server.process.wait(60) == 0
    finally:
        server.stop()
    log = server.log_text()
    assert "was killed by signal" not in log, log
    assert "launcher of Paddle workers ended" not in log, log
    assert [command for pid, command in below.items() if alive(pid)] == []
