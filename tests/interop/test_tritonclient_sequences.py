"""Sequences of the `kws` example (a stateful GRU keyword spotter) through Triton's own client,
tritonclient, in its own process (tritonclient_sequence_check.py): interleaved sequences with
integer and string ids over HTTP/2 (unary and one stream), and tritonclient's messages, stub
and result over HTTP/3 on QuicChannel, each answer what the sequence gives alone."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.reference import kws_reference
from tests.servers import REPO_ROOT, ServerProcess, model_repository, running_server

Array = np.ndarray[Any, Any]
SCRIPT = Path(__file__).with_name("tritonclient_sequence_check.py")
COUNT, LENGTH = 4, 4
WAYS = ("h2", "h2-stream", "h3")
CHECK_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("tritonclient_sequences")
    repository = model_repository(root / "models", ["kws"])
    rng = np.random.default_rng(5)
    chunks = {
        f"{s}.{i}": rng.standard_normal((1, 8, 40), dtype=np.float32)
        for s in range(COUNT)
        for i in range(LENGTH)
    }
    np.savez(root / "inputs.npz", **chunks)  # type: ignore[arg-type]
    with running_server(repository, root / "log", ["--certs-dir", str(certs_dir)]) as server:
        command = [
            *(sys.executable, str(SCRIPT), "--address", server.address),
            *("--h3", f"localhost:{server.port}", "--ca-file", str(certs_dir / "ca.pem")),
            *("--inputs", str(root / "inputs.npz"), "--out", str(root / "out.npz")),
        ]
        finished = subprocess.run(
            command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
        )
        assert finished.returncode == 0, finished.stderr
        with np.load(root / "out.npz") as data:
            yield {
                "summary": json.loads(str(data["summary"])),
                "outputs": {n: data[n] for n in data.files if n != "summary"},
                "chunks": chunks,
                "server": server,
            }


def test_tritonclient_raised_nothing(run: dict[str, Any]) -> None:
    assert run["summary"]["errors"] == {}
    ids = run["summary"]["ids"]["h2"]
    assert isinstance(ids[0], int) and isinstance(ids[1], str)  # both kinds of sequence id


@pytest.mark.parametrize("way", WAYS)
def test_interleaved_sequences_answer_as_alone(run: dict[str, Any], way: str) -> None:
    for s in range(COUNT):
        expected = kws_reference([run["chunks"][f"{s}.{i}"] for i in range(LENGTH)])
        for i, reference in enumerate(expected):
            served = run["outputs"][f"{way}.{s}.{i}"]
            np.testing.assert_allclose(served, reference, rtol=1e-4, atol=1e-6)


def test_every_sequence_ended(run: dict[str, Any]) -> None:
    server: ServerProcess = run["server"]
    live = [s.value for s in server.metrics() if s.name == "paddlequic_live_sequences"]
    assert live == [0.0]
