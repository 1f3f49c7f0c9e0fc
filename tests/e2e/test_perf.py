"""`paddlequic perf` against a real server over both transports. Durations are tiny: these
check what it reports and that requests succeeded, never how fast."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from protos.inference import grpc_service_pb2 as pb
from tests.servers import REPO_ROOT, ServerProcess, model_repository, running_server

QUICK = ["--duration", "0.4", "--warmup", "0.2"]
SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("perf")
    repository = model_repository(root / "models", ["mlp", "text_classifier"])
    with running_server(repository, root / "log", ["--certs-dir", str(certs_dir)]) as process:
        yield process


def url(server: ServerProcess, transport: str) -> str:
    return f"h3://localhost:{server.port}" if transport == "h3" else server.url


def perf(certs_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "clients.cli", "perf", "--ca-file", str(certs_dir / "ca.pem")]
    return subprocess.run(
        [*command, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def table(stdout: str) -> list[dict[str, str]]:
    """The printed table as dicts (its columns are separated by two or more spaces)."""
    header, *lines = [re.split(r"\s{2,}", line.strip()) for line in stdout.strip().splitlines()]
    return [dict(zip(header, line, strict=True)) for line in lines]


@pytest.mark.parametrize("transport", ["h2", "h3"])
def test_a_concurrency_range_gives_a_row_per_level(
    server: ServerProcess, certs_dir: Path, tmp_path: Path, transport: str
) -> None:
    out = tmp_path / "perf.json"
    done = perf(
        certs_dir, "mlp", "--url", url(server, transport), "--concurrency-range", "1:4:x2",
        "--percentile", "95", "-f", str(out), *QUICK,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = table(done.stdout)
    assert [r["concurrency"] for r in rows] == ["1", "2", "4"]
    assert {r["errors"] for r in rows} == {"-"}
    assert {"req/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "client CPU us/req"} <= set(rows[0])
    document: dict[str, Any] = json.loads(out.read_text())
    assert (document["model"], document["transport"], document["batch_size"]) == (
        "mlp",
        transport,
        1,
    )
    assert document["inputs"] == {"input": {"shape": [1, 256], "datatype": "float32"}}
    for row in document["rows"]:
        assert row["requests"] > 0 and row["errors"] == {}
        assert set(row["latency_ms"]) == {"avg", "p50", "p90", "p95", "p99"}
        assert row["latency_ms"]["p50"] <= row["latency_ms"]["p99"]
        assert row["connect"] == "reuse" and row["connect_modes"] == {}


def test_streaming_with_variable_dims_batches_and_csv(
    server: ServerProcess, certs_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "perf.csv"
    metrics = re.search(r"metrics on (http://\S+/metrics)", server.log_text())
    assert metrics is not None
    done = perf(
        certs_dir, "text_classifier", "--url", server.url, "--streaming",
        "--concurrency-range", "2",
        "--shape", "token_ids:12", "-b", "3", "--input-data", "zero", "-f", str(out),
        "--server-metrics", metrics.group(1), *QUICK,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "token_ids [3, 12] int64" in done.stderr
    with out.open() as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["concurrency"] == "2" and row["errors"] == "-"
    assert int(row["requests"]) > 0
    assert float(row["inferences_per_s"]) == pytest.approx(3 * float(row["throughput_rps"]))
    assert float(row["server_cpu_us"]) > 0 and float(row["client_cpu_us"]) > 0
    assert float(row["worker_cpu_us"]) > 0


def test_connect_each_shows_full_handshakes_and_0rtt(
    server: ServerProcess, certs_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "perf.json"
    done = perf(
        certs_dir, "mlp", "--url", url(server, "h3"), "--connect-each", "both",
        "--concurrency-range", "1", "-f", str(out), *QUICK,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [r["connect"] for r in table(done.stdout)] == ["full", "0rtt"]
    full, zero_rtt = json.loads(out.read_text())["rows"]
    assert full["requests"] > 0 and set(full["connect_modes"]) == {"full"}
    # A caller's first connection has no ticket yet; it falls in the warm-up.
    assert zero_rtt["requests"] > 0 and zero_rtt["connect_modes"].get("0rtt-accepted", 0) > 0


def test_every_reconnect_with_a_ticket_takes_0rtt(
    server: ServerProcess, certs_dir: Path, tmp_path: Path
) -> None:
    """Each caller's first connection (no ticket yet) falls in the warm-up; every connection
    measured after it resumed with its early data accepted, one caller or eight."""
    out = tmp_path / "perf.json"
    done = perf(
        certs_dir, "mlp", "--url", url(server, "h3"), "--connect-each", "0rtt",
        "--concurrency-range", "1,8", "-f", str(out), "--duration", "0.5", "--warmup", "0.5",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 8]
    for row in rows:
        assert row["requests"] > 0 and row["connect_modes"] == {"0rtt-accepted": row["requests"]}


def test_failed_requests_are_counted_by_code(
    server: ServerProcess, certs_dir: Path, tmp_path: Path
) -> None:
    np.save(tmp_path / "input.npy", np.zeros((1, 255), np.float32))
    out = tmp_path / "perf.json"
    done = perf(
        certs_dir, "mlp", "--url", server.url, "--input-data", str(tmp_path), "-f", str(out), *QUICK
    )
    assert done.returncode == 1  # no request succeeded
    (row,) = json.loads(out.read_text())["rows"]
    assert row["requests"] == 0 and row["errors"]["INVALID_ARGUMENT"] > 0
    assert row["latency_ms"]["p99"] is None
    assert "INVALID_ARGUMENT:" in table(done.stdout)[0]["errors"]


@pytest.mark.parametrize("transport", ["h2", "h3"])
def test_tensors_in_shared_memory_are_registered_for_the_run_only(
    server: ServerProcess, certs_dir: Path, tmp_path: Path, transport: str
) -> None:
    """--shared-memory system: every request names the regions perf registered (its input
    read there, its output written there); a region too small for the output fails each
    request in the server's words; either way the regions and their objects are gone after."""
    out = tmp_path / "perf.json"
    before = set(SHM.glob("pq-perf-*"))
    done = perf(
        certs_dir, "mlp", "--url", url(server, transport), "--shared-memory", "system",
        "--concurrency-range", "2", "-f", str(out), *QUICK,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    document: dict[str, Any] = json.loads(out.read_text())
    assert document["shared_memory"] == "system"
    (row,) = document["rows"]
    assert row["requests"] > 0 and row["errors"] == {}
    too_small = perf(
        certs_dir, "mlp", "--url", url(server, transport), "--shared-memory", "system",
        "--output-shared-memory-size", "4", *QUICK,
    )  # fmt: skip
    assert too_small.returncode == 1  # no request succeeded
    assert table(too_small.stdout)[0]["errors"].startswith("INVALID_ARGUMENT:")
    status = server.stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
    assert not [name for name in status.regions if name.startswith("pq-perf-")]
    assert set(SHM.glob("pq-perf-*")) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--connect-each", "0rtt"], "needs an h3:// URL"),
        (["--concurrency-range", "8:1"], "--concurrency-range takes"),
        (["--shape", "nope:3"], "names no input of the model: ['nope']"),
    ],
)
def test_bad_options_are_refused_with_a_reason(
    server: ServerProcess, certs_dir: Path, args: list[str], message: str
) -> None:
    done = perf(certs_dir, "mlp", "--url", server.url, *args, *QUICK)
    assert done.returncode == 2 and message in done.stderr, done.stderr
