"""perf's pure parts: concurrency ranges, shapes and inputs, and the summary of a step."""

from __future__ import annotations

import asyncio
import csv
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from clients.perf.command import parse_concurrency
from clients.perf.inputs import model_inputs, parse_shapes
from clients.perf.load import Step, server_cpu
from clients.perf.report import summarize, table, write
from protos.inference import grpc_service_pb2 as pb


@pytest.mark.parametrize(
    ("text", "levels"),
    [
        ("4", [4]),
        ("1,4,16", [1, 4, 16]),
        ("1:4", [1, 2, 3, 4]),
        ("2:10:4", [2, 6, 10]),
        ("1:64:x2", [1, 2, 4, 8, 16, 32, 64]),
        ("1:48:x4", [1, 4, 16, 48]),
    ],
)
def test_concurrency_ranges(text: str, levels: list[int]) -> None:
    assert parse_concurrency(text) == levels


@pytest.mark.parametrize("text", ["", "0", "8:1", "1:8:0", "1:8:x1", "a:b", "1:5000", "1,-2"])
def test_bad_concurrency_ranges_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--concurrency-range takes"):
        parse_concurrency(text)


def metadata() -> pb.ModelMetadataResponse:
    response = pb.ModelMetadataResponse(name="m")
    response.inputs.add(name="ids", datatype="INT64", shape=[-1, -1])
    response.inputs.add(name="mask", datatype="BOOL", shape=[-1, 4])
    return response


def test_inputs_take_the_batch_size_and_shape_flags() -> None:
    shapes = parse_shapes(["ids:7"])
    arrays = model_inputs(metadata(), True, 3, shapes, "random")
    assert (arrays["ids"].shape, arrays["ids"].dtype) == ((3, 7), np.int64)
    assert (arrays["mask"].shape, arrays["mask"].dtype) == ((3, 4), np.bool_)
    zero = model_inputs(metadata(), False, 1, {"ids": (2, 5), "mask": (2, 4)}, "zero")
    assert zero["ids"].shape == (2, 5) and not zero["ids"].any()


def test_variable_dims_without_a_shape_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--shape ids:16"):
        model_inputs(metadata(), True, 1, {}, "random")
    with pytest.raises(ValueError, match="NAME:d0,d1"):
        parse_shapes(["ids"])


def test_inputs_from_npy_files(tmp_path: Path) -> None:
    np.save(tmp_path / "ids.npy", np.arange(6, dtype=np.int64).reshape(2, 3))
    with pytest.raises(ValueError, match=r"mask\.npy is missing"):
        model_inputs(metadata(), True, 1, {}, str(tmp_path))
    np.save(tmp_path / "mask.npy", np.ones((2, 4), np.int32))
    with pytest.raises(ValueError, match="holds INT32, the model wants BOOL"):
        model_inputs(metadata(), True, 1, {}, str(tmp_path))
    np.save(tmp_path / "mask.npy", np.ones((2, 4), bool))
    assert model_inputs(metadata(), True, 1, {}, str(tmp_path))["ids"].tolist() == [
        [0, 1, 2],
        [3, 4, 5],
    ]


def test_a_step_summary_and_its_table_csv_and_json(tmp_path: Path) -> None:
    step = Step(
        concurrency=4,
        connect="0rtt",
        window_s=2.0,
        latencies_ns=[int(ms * 1e6) for ms in range(1, 101)],
        errors={"UNAVAILABLE": 2},
        modes={"0rtt-accepted": 98, "full": 4},
        client_cpu_s=0.0102,
    )
    row = summarize(step, batch_size=8, percentiles=[50, 90, 95, 99])
    assert (row.requests, row.throughput, row.inferences) == (100, 50.0, 400.0)
    assert row.latency_ms["p50"] == pytest.approx(50.5)
    assert row.latency_ms["p99"] == pytest.approx(99.01)
    assert row.client_cpu_us == pytest.approx(100.0)  # over 102 answered requests
    assert row.server_cpu_us is None and row.worker_cpu_us is None
    lines = table([row]).splitlines()
    assert lines[0].split()[:3] == ["concurrency", "connect", "req/s"]
    assert "UNAVAILABLE:2" in lines[1] and "0rtt-accepted:98 full:4" in lines[1]
    write(tmp_path / "r.csv", [row], {})
    with (tmp_path / "r.csv").open() as handle:
        (written,) = list(csv.DictReader(handle))
    assert (written["connect"], written["latency_p95_ms"]) == ("0rtt", "95.0500")
    write(tmp_path / "r.json", [row], {"model": "m"})
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["model"] == "m" and document["rows"][0]["errors"] == {"UNAVAILABLE": 2}


def test_a_step_without_successes_has_no_latencies() -> None:
    row = summarize(Step(1, "reuse", 1.0, [], {"INVALID_ARGUMENT": 9}), 1, [50, 99])
    assert row.latency_ms == {"avg": None, "p50": None, "p99": None}
    assert "-" in table([row]).splitlines()[1].split()


def test_a_decoupled_step_reports_time_to_first_token_and_tokens_per_second(
    tmp_path: Path,
) -> None:
    step = Step(
        concurrency=2,
        connect="reuse",
        window_s=4.0,
        latencies_ns=[int(1e9)] * 10,
        first_token_ns=[int(ms * 1e6) for ms in range(1, 11)],
        inter_token_ns=[int(2e6)] * 30 + [int(4e6)] * 10,
        tokens=50,
    )
    row = summarize(step, 1, [50, 90, 99], decoupled=True)
    assert row.tokens_per_s == pytest.approx(12.5)
    assert row.time_to_first_token_ms == pytest.approx({"p50": 5.5, "p99": 9.91})
    assert row.inter_token_ms == pytest.approx({"p50": 2.0, "p99": 4.0})
    header, line = table([row]).splitlines()
    names = [n.strip() for n in header.split("  ") if n.strip()]
    assert names[-4:] == ["tokens/s", "TTFT p50 ms", "TTFT p99 ms", "inter-token p50 ms"]
    assert line.split()[-4:] == ["12.5", "5.50", "9.91", "2.00"]
    write(tmp_path / "r.json", [row], {})
    (written,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert written["tokens_per_s"] == pytest.approx(12.5)
    assert written["time_to_first_token_ms"]["p99"] == pytest.approx(9.91)
    # A model answering once per request has none of these.
    plain = summarize(step, 1, [50, 90, 99])
    assert (plain.tokens_per_s, plain.time_to_first_token_ms) == (None, None)
    assert "tokens/s" not in table([plain])


SCRAPE = b"""# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 1.5
# HELP paddlequic_frontend_cpu_seconds_total CPU time of a front-end process
# TYPE paddlequic_frontend_cpu_seconds_total counter
paddlequic_frontend_cpu_seconds_total{frontend="1"} 2.25
paddlequic_frontend_cpu_seconds_total{frontend="2"} 3.0
paddlequic_frontend_calls_total{frontend="1",transport="h2"} 100.0
# HELP paddlequic_worker_cpu_seconds_total CPU time of each instance's worker process
# TYPE paddlequic_worker_cpu_seconds_total counter
paddlequic_worker_cpu_seconds_total{instance="mlp_0",model="mlp",version="1"} 4.5
paddlequic_worker_cpu_seconds_total{instance="mlp_1",model="mlp",version="1"} 0.25
"""


@pytest.fixture
def metrics_url() -> Iterator[str]:
    """A /metrics endpoint answering SCRAPE, as a server with two front-ends writes it."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(SCRAPE)))
            self.end_headers()
            self.wfile.write(SCRAPE)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_the_servers_cpu_is_the_parents_and_every_front_ends(metrics_url: str) -> None:
    """With --frontends N, process_* is the parent's alone: the calls the front-ends serve
    show in their own counters, which --server-metrics adds; the workers' apart."""
    cpu = asyncio.run(server_cpu(metrics_url))
    assert cpu is not None
    assert (cpu.holding, cpu.workers) == pytest.approx((1.5 + 2.25 + 3.0, 4.5 + 0.25))
    assert asyncio.run(server_cpu("")) is None
