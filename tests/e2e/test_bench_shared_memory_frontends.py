"""`make bench`'s shared memory through front-ends (scripts/bench_shared_memory_frontends.py)
at its smallest: a round on a server with --frontends 2 gives a row whose parts are measured;
never how fast."""

from __future__ import annotations

from pathlib import Path

from scripts.bench_shared_memory_frontends import MODEL, WAYS, measure, summary
from tests.servers import model_repository, running_server


def test_a_round_gives_a_row_of_each_way(tmp_path: Path) -> None:
    repository = model_repository(tmp_path / "models", [MODEL])
    rows = []
    for way, extra in WAYS.items():
        args = ["--no-h3", "--frontends", "2", *extra]
        with running_server(repository, tmp_path / f"{way}.log", args) as server:
            rows.append(measure(server, way, 0, 0.3, tmp_path / "perf.json", warmup=0.1))
    for row in rows:
        assert row.requests_per_s > 0 and row.server_cpu_us_per_request > 0, row
        assert row.parent_cpu_us_per_request >= 0, row
    assert "served in the front-ends / through the parent" in summary(rows)
