"""`make bench`'s shared memory through front-ends: `mlp`, one row per request, its tensors in
system shared memory (`paddlequic perf --shared-memory system`, CONCURRENCY callers), on a
server with `--frontends 2` whose front-ends hold copies of the regions and serve such calls
themselves, against one with `--no-frontend-queues`, where every call goes through the parent
(as every call naming a region did before front-ends held copies). Alternating rounds in one
run; each ratio is taken within its round.

Per request: the CPU of the processes holding calls (parent and front-ends), of the workers,
and of the parent alone, whose part in a call is the point: with copies it should be none."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from scripts.bench_common import finish, median_range, round_ratios, rounds_parser
from tests.servers import REPO_ROOT, ServerProcess, model_repository

MODEL = "mlp"
CONCURRENCY = 32
WAYS = {"front-ends": (), "parent": ("--no-frontend-queues",)}


@dataclass
class Row:
    way: str
    round: int
    requests_per_s: float
    server_cpu_us_per_request: float  # parent and front-ends
    worker_cpu_us_per_request: float | None
    parent_cpu_us_per_request: float


def parent_cpu_s(server: ServerProcess) -> float:
    found = re.search(r"^process_cpu_seconds_total (\S+)", server.metrics_text(), re.M)
    assert found is not None, "the server's /metrics shows no process_cpu_seconds_total"
    return float(found.group(1))


def measure(
    server: ServerProcess, way: str, index: int, duration: float, out: Path, warmup: float = 1.0
) -> Row:
    metrics = re.search(r"metrics on (http://\S+/metrics)", server.log_text())
    assert metrics is not None
    before = parent_cpu_s(server)
    done = subprocess.run(
        [
            sys.executable, "-m", "clients.cli", "perf", MODEL, "--url", server.url,
            "--shared-memory", "system", "--concurrency-range", str(CONCURRENCY),
            "--warmup", str(warmup), "--duration", str(duration),
            "--server-metrics", metrics.group(1), "-f", str(out),
        ],
        cwd=REPO_ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"perf failed ({way}):\n{done.stderr}")
    spent = parent_cpu_s(server) - before
    (step,) = json.loads(out.read_text())["rows"]
    # The parent's CPU over the whole run (warm-up and measurement) per request answered in it.
    answered = step["throughput"] * (warmup + duration)
    return Row(
        way,
        index,
        round(step["throughput"], 1),
        round(step["server_cpu_us"], 1),
        None if step["worker_cpu_us"] is None else round(step["worker_cpu_us"], 1),
        round(spent / answered * 1e6, 1),
    )


def summary(rows: list[Row]) -> str:
    speed = round_ratios(rows, "front-ends", "parent", "requests_per_s")
    cpu = round_ratios(rows, "front-ends", "parent", "server_cpu_us_per_request")
    lines = [f"{'way':<11} {'req/s':>8} {'server CPU us/req':>18} {'worker':>7} {'parent':>7}"]
    for way in WAYS:
        group = [r for r in rows if r.way == way]
        workers = [r.worker_cpu_us_per_request for r in group if r.worker_cpu_us_per_request]
        lines.append(
            f"{way:<11} {statistics.median(r.requests_per_s for r in group):>8.1f} "
            f"{statistics.median(r.server_cpu_us_per_request for r in group):>18.0f} "
            f"{statistics.median(workers) if workers else float('nan'):>7.0f} "
            f"{statistics.median(r.parent_cpu_us_per_request for r in group):>7.1f}"
        )
    lines.append(
        f"{MODEL} c={CONCURRENCY}, tensors in shared memory, --frontends 2, served in the "
        f"front-ends / through the parent: requests/s {median_range(speed)}, server CPU per "
        f"request {median_range(cpu)}"
    )
    return "\n".join(lines)


def main() -> int:
    parser = rounds_parser(__doc__, "shared_memory_frontends.json")
    args = parser.parse_args()
    print(f"{MODEL}: starting two servers with --frontends 2", flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        repository = model_repository(Path(tmp) / "models", [MODEL])
        servers: dict[str, ServerProcess] = {}
        try:
            for way, extra in WAYS.items():
                log = Path(tmp) / f"{way}.log"
                servers[way] = ServerProcess(
                    repository, log, ["--no-h3", "--frontends", "2", *extra]
                )
            for server in servers.values():
                server.wait_ready()
            for index in range(args.rounds):
                for way in WAYS if index % 2 == 0 else reversed(WAYS):
                    row = measure(servers[way], way, index, args.duration, Path(tmp) / "perf.json")
                    rows.append(row)
                    print(
                        f"  round {index} {way:<10} {row.requests_per_s:>7.1f} req/s, server "
                        f"{row.server_cpu_us_per_request:>5.0f} us CPU per request, parent "
                        f"{row.parent_cpu_us_per_request:>5.1f}",
                        flush=True,
                    )
        finally:
            for server in servers.values():
                server.stop()
    return finish(summary(rows), args.out, rows)


if __name__ == "__main__":
    raise SystemExit(main())
