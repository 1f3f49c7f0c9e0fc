"""`make bench-http` (scripts/bench_http.py) in its smallest configuration: every server it
starts answers on every protocol, and the JSON holds a row for each; never how fast."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from scripts.bench_peers import MLSERVER_VENV, mlserver_missing
from tests.e2e.test_bench_peers import run_bench

pytestmark = pytest.mark.e2e


def bench(out: Path, servers: str) -> tuple[str, list[dict[str, Any]]]:
    output, rows = run_bench("scripts.bench_http", ["--servers", servers], out)
    for row in rows:
        assert row["round"] == 0
        # A generation of 32 tokens may outlast a 0.5 s window on a busy machine (none ended
        # in it once, with three test processes on two cores): a stream's tokens, which the
        # server counts, say it ran.
        streamed = row["protocol"] in ("grpc-stream", "sse")
        assert (row["tokens"] if streamed else row["calls"] * row["per_second"]) > 0, row
        assert row["cpu_us"] >= row["main_cpu_us"] >= 0, row
    return output, rows


def test_rest_grpc_and_their_streams_each_give_a_row_and_the_goals(tmp_path: Path) -> None:
    stdout, rows = bench(tmp_path / "http.json", "paddlequic")
    assert sorted((r["model"], r["concurrency"], r["protocol"]) for r in rows) == [
        ("generate", 8, "grpc-stream"),
        ("generate", 8, "sse"),
        ("mlp", 32, "grpc"),
        ("mlp", 32, "rest-binary"),
        ("mlp", 32, "rest-json"),
    ]
    # Both streams generate, counted by the server's own token counter.
    assert all(r["tokens"] > 0 and r["cpu_us_per_token"] > 0 for r in rows if r["tokens"])
    assert sum(1 for r in rows if r["tokens"]) == 2
    assert "paddlequic rest-binary / grpc, CPU per call:" in stdout
    assert "paddlequic sse / grpc-stream, CPU per token:" in stdout


@pytest.mark.skipif(
    importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None,
    reason="fastapi and uvicorn (dev dependencies) are not installed",
)
def test_the_fastapi_peer_answers_the_same_json(tmp_path: Path) -> None:
    _, rows = bench(tmp_path / "http.json", "fastapi")
    assert [(r["server"], r["protocol"]) for r in rows] == [("fastapi", "rest-json")]


@pytest.mark.skipif(
    mlserver_missing() is not None, reason=f"{MLSERVER_VENV.name} is absent (make bench-http)"
)
def test_mlserver_answers_over_rest(tmp_path: Path) -> None:
    _, rows = bench(tmp_path / "http.json", "mlserver")
    assert [(r["server"], r["protocol"]) for r in rows] == [("mlserver", "rest-json")]
