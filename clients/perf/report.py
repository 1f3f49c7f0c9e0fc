"""perf's results: one row per step, printed as a table and written as CSV or JSON."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clients.perf.load import Step

PERCENTILES = (50, 90, 99)
TOKEN_PERCENTILES = (50, 99)


@dataclass(frozen=True)
class Row:
    concurrency: int
    connect: str
    requests: int  # successful requests in the window
    throughput: float  # successful requests per second
    inferences: float  # rows per second (requests x batch size)
    latency_ms: dict[str, float | None]  # avg and pNN of successful requests (None: none)
    errors: dict[str, int]  # failed requests by status code
    connect_modes: dict[str, int]  # new connections by how they started
    client_cpu_us: float | None  # this process's CPU per request
    server_cpu_us: float | None  # the server's CPU per request, workers aside (--server-metrics)
    worker_cpu_us: float | None  # its workers' CPU per request (--server-metrics)
    # Decoupled models only (None otherwise): time to first token and inter-token gaps
    # (p50, p99), and data responses (tokens) per second in the window.
    time_to_first_token_ms: dict[str, float | None] | None = None
    inter_token_ms: dict[str, float | None] | None = None
    tokens_per_s: float | None = None


def _distribution(
    values_ns: Sequence[int], percentiles: Sequence[int], average: bool = True
) -> dict[str, float | None]:
    """Milliseconds: avg (unless not asked for) and pNN; None where nothing was measured."""
    values = np.asarray(values_ns, dtype=np.float64) / 1e6
    result: dict[str, float | None] = {"avg": None} if average else {}
    result.update({f"p{p}": None for p in percentiles})
    if values.size:
        if average:
            result["avg"] = float(values.mean())
        for p in percentiles:
            result[f"p{p}"] = float(np.percentile(values, p))
    return result


def summarize(
    step: Step, batch_size: int, percentiles: Sequence[int], decoupled: bool = False
) -> Row:
    latency = _distribution(step.latencies_ns, percentiles)
    answered = len(step.latencies_ns) + sum(step.errors.values())
    per_request = 1e6 / answered if answered else None
    return Row(
        concurrency=step.concurrency,
        connect=step.connect,
        requests=len(step.latencies_ns),
        throughput=len(step.latencies_ns) / step.window_s,
        inferences=len(step.latencies_ns) * batch_size / step.window_s,
        latency_ms=latency,
        errors=dict(sorted(step.errors.items())),
        connect_modes=dict(sorted(step.modes.items())),
        client_cpu_us=step.client_cpu_s * per_request if per_request else None,
        server_cpu_us=_per(step.server_cpu_s, per_request),
        worker_cpu_us=_per(step.worker_cpu_s, per_request),
        time_to_first_token_ms=(
            _distribution(step.first_token_ns, TOKEN_PERCENTILES, False) if decoupled else None
        ),
        inter_token_ms=(
            _distribution(step.inter_token_ns, TOKEN_PERCENTILES, False) if decoupled else None
        ),
        tokens_per_s=step.tokens / step.window_s if decoupled else None,
    )


def _per(seconds: float | None, per_request: float | None) -> float | None:
    return None if seconds is None or per_request is None else seconds * per_request


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in counts.items()) or "-"


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(rows: Sequence[Row]) -> str:
    """Aligned columns, one line per row, for a terminal."""
    if not rows:
        return ""
    names = [k for k in rows[0].latency_ms if k != "avg"]
    header = ["concurrency", "connect", "req/s", "infer/s", "avg ms"]
    header += [f"{n} ms" for n in names] + ["errors", "client CPU us/req", "server CPU us/req"]
    header.append("worker CPU us/req")
    with_modes = any(r.connect_modes for r in rows)
    if with_modes:
        header.append("connections")
    with_tokens = any(r.tokens_per_s is not None for r in rows)
    if with_tokens:
        header += ["tokens/s", "TTFT p50 ms", "TTFT p99 ms", "inter-token p50 ms"]
    lines = [header]
    for r in rows:
        line = [str(r.concurrency), r.connect, f"{r.throughput:.1f}", f"{r.inferences:.1f}"]
        line += [_number(r.latency_ms[k], 2) for k in ("avg", *names)]
        line += [_counts(r.errors), _number(r.client_cpu_us, 0), _number(r.server_cpu_us, 0)]
        line.append(_number(r.worker_cpu_us, 0))
        if with_modes:
            line.append(_counts(r.connect_modes))
        if with_tokens:
            first, gaps = r.time_to_first_token_ms or {}, r.inter_token_ms or {}
            line += [_number(r.tokens_per_s, 1), _number(first.get("p50"), 2)]
            line += [_number(first.get("p99"), 2), _number(gaps.get("p50"), 2)]
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.rjust(w) if i != 1 else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in lines
    )


def write(path: Path, rows: Sequence[Row], run: dict[str, Any]) -> None:
    """`.json`: the run's settings and every row; anything else: CSV, one line per row."""
    if path.suffix == ".json":
        document = {**run, "rows": [asdict(r) for r in rows]}
        path.write_text(json.dumps(document, indent=2) + "\n")
        return
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        names = list(rows[0].latency_ms) if rows else []
        writer.writerow(
            ["concurrency", "connect", "requests", "throughput_rps", "inferences_per_s"]
            + [f"latency_{n}_ms" for n in names]
            + ["errors", "client_cpu_us", "server_cpu_us", "worker_cpu_us", "connect_modes"]
        )
        for r in rows:
            writer.writerow(
                [r.concurrency, r.connect, r.requests, f"{r.throughput:.3f}", f"{r.inferences:.3f}"]
                + [_number(r.latency_ms[n], 4) for n in names]
                + [
                    _counts(r.errors),
                    _number(r.client_cpu_us, 1),
                    _number(r.server_cpu_us, 1),
                    _number(r.worker_cpu_us, 1),
                    _counts(r.connect_modes),
                ]
            )
