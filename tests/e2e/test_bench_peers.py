"""`make bench-peers` (scripts/bench_peers.py) in its smallest configuration: every server it
starts answers, and the JSON holds a row for each; never how fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scripts.bench_peers import MLSERVER_VENV, mlserver_missing
from tests.servers import REPO_ROOT

pytestmark = pytest.mark.e2e
# Starting the servers and Paddle takes most of it: minutes on a loaded 2-core machine; pytest
# ends a test after 300 s.
BENCH_TIMEOUT_S = 200


def run_bench(module: str, args: list[str], out: Path) -> tuple[str, list[dict[str, Any]]]:
    """A benchmark script at its smallest (one round of 0.5 s), its JSON written to `out`:
    what it printed and its rows."""
    command = [sys.executable, "-m", module, "--rounds", "1", "--duration", "0.5"]
    command += [*args, "--out", str(out)]
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = process.communicate(timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.terminate()  # a TERM, not a kill: the script stops the servers it started
        output, _ = process.communicate(timeout=60)
        raise AssertionError(f"still running after {BENCH_TIMEOUT_S} s:\n{output}") from None
    assert process.returncode == 0, output
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    return output, rows


def bench(out: Path, servers: str) -> tuple[str, list[dict[str, Any]]]:
    output, rows = run_bench("scripts.bench_peers", ["--models", "mlp", "--servers", servers], out)
    for row in rows:
        assert (row["model"], row["concurrency"], row["round"]) == ("mlp", 32, 0)
        assert row["calls"] > 0 and row["per_second"] > 0, row
        assert row["cpu_us"] >= row["main_cpu_us"] >= 0, row
    return output, rows


def test_paddlequic_the_grpcio_peer_and_the_ceiling_each_give_a_row_and_ratios(
    tmp_path: Path,
) -> None:
    stdout, rows = bench(tmp_path / "peers.json", "paddlequic,paddlequic-batcher,grpcio,canned")
    assert sorted((r["server"], r["rpc"]) for r in rows) == [
        ("canned", "ModelInfer"),
        ("grpcio", "ModelInfer"),
        ("paddlequic", "ModelInfer"),
        ("paddlequic", "ServerLive"),
        ("paddlequic-batcher", "ModelInfer"),
        ("paddlequic-batcher", "ServerLive"),
    ]
    # paddlequic's workers are processes of its own, counted apart from its server process.
    (ours,) = (r for r in rows if r["server"] == "paddlequic" and r["rpc"] == "ModelInfer")
    assert ours["processes"] > 1 and ours["workers_cpu_us"] > 0
    assert ours["frontends_cpu_us"] == 0
    assert "paddlequic / best peer (grpcio), calls/s:" in stdout
    assert "paddlequic / canned ceiling, calls/s:" in stdout
    assert "paddlequic ModelInfer / bare ServerLive, CPU per call: all processes" in stdout
    assert "paddlequic-batcher / best peer (grpcio), calls/s:" in stdout
    assert "paddlequic-batcher ModelInfer / bare ServerLive, CPU per call" in stdout


@pytest.mark.skipif(
    mlserver_missing() is not None, reason=f"{MLSERVER_VENV.name} is absent (make bench-peers)"
)
def test_mlserver_with_adaptive_batching_runs_the_paddle_runtime(tmp_path: Path) -> None:
    _, rows = bench(tmp_path / "peers.json", "mlserver-batching")
    assert [(r["server"], r["rpc"]) for r in rows] == [("mlserver-batching", "ModelInfer")]
