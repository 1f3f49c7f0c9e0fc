"""`make bench-density`: how many models one host holds. N copies of the example `mlp` (a tiny
model) and the example repository, served with Paddle workers forked from the preloaded
launcher and, as the reference, with every worker started afresh (`--no-preloaded-launcher`);
and `resnet18` with `instance_group` count 4, its instances forked from one model template
that built the predictor (the default) and, as the reference, each building its own
(`--no-model-templates`): time until ServerReady, each worker's private memory (USS: private
clean + private dirty, from /proc/PID/smaps_rollup), the memory of the whole process tree
(PSS, which splits each shared page among its sharers) and whether every copy answered a
call.

Goals (issue: many models on one host, 2 cores): median worker USS at most 20 MB, total PSS at
most 25 MB x N + 300 MB and READY within 0.25 s x N + 10 s.

Then, with `--budget-copies N` (default 60) and `--budget MB` (default 200): N copies of mlp
under `--model-memory-budget`, each called once in turn (so each call loads its model and,
once the budget is full, evicts the least recently used): the calls' latencies, the models
resident at the end, the whole tree's PSS, and the loads and evictions the metrics count.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from scripts.bench_common import write_json
from tests.servers import EXAMPLE_MODELS, ServerProcess, descendants, model_repository

SIZES = (10, 50, 200)
INSTANCES = 4  # of resnet18
# A fresh worker holds about 135 MB of its own: past this many copies the reference would not
# fit in this machine's memory, so it is left out (and the table says so).
FRESH_MAX_COPIES = 60
READY_LIMIT_S = 1800.0
RESULTS = Path("bench-results/bench_density.json")
MLP_INPUTS = {"input": np.zeros((1, 256), np.float32)}
RESNET_INPUTS = {"image": np.zeros((1, 3, 224, 224), np.float32)}
# How each launcher is asked for: "template" and "preloaded" differ only for a model with more
# than one instance.
FLAGS = {
    "template": ["--preloaded-launcher", "--model-templates"],
    "preloaded": ["--preloaded-launcher", "--no-model-templates"],
    "fresh": ["--no-preloaded-launcher"],
}


@dataclass
class BudgetRow:
    models: int
    budget_mb: int
    resident: int  # models READY at the end
    total_pss_mb: float
    loads: int
    evictions: int
    answered: int
    first_call_median_s: float  # a call to a model not in memory: its load (and an eviction)
    first_call_max_s: float
    resident_call_ms: float  # a call to a model in memory, for comparison


@dataclass
class Row:
    repository: str
    models: int
    launcher: str  # "template", "preloaded" or "fresh" (FLAGS)
    ready_s: float
    workers: int
    median_worker_uss_mb: float
    total_pss_mb: float
    answered: int
    goal_uss: bool
    goal_pss: bool
    goal_ready: bool


def copies_of_mlp(root: Path, count: int) -> tuple[Path, list[str]]:
    """`count` models named mlp_0001..., each its own directory: a config naming it and the
    example's version directory (symlinked)."""
    config = (EXAMPLE_MODELS / "mlp" / "config.pbtxt").read_text()
    names = [f"mlp_{i:04d}" for i in range(1, count + 1)]
    for name in names:
        target = root / name
        target.mkdir(parents=True)
        (target / "config.pbtxt").write_text(config.replace('name: "mlp"', f'name: "{name}"'))
        (target / "1").symlink_to(EXAMPLE_MODELS / "mlp" / "1")
    return root, names


def instances_of_resnet18(root: Path, count: int) -> tuple[Path, list[str]]:
    """The example resnet18 with `count` instances."""
    config = (EXAMPLE_MODELS / "resnet18" / "config.pbtxt").read_text()
    target = root / "resnet18"
    target.mkdir(parents=True)
    (target / "config.pbtxt").write_text(config.replace("count: 1", f"count: {count}"))
    (target / "1").symlink_to(EXAMPLE_MODELS / "resnet18" / "1")
    return root, ["resnet18"]


def memory_kb(pid: int) -> tuple[int, int]:
    """(USS, PSS) of one process, in kB."""
    uss = pss = 0
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0, 0
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("Private_Clean", "Private_Dirty"):
            uss += int(value.split()[0])
        elif key == "Pss":
            pss += int(value.split()[0])
    return uss, pss


def wait_ready(server: ServerProcess, started: float) -> float:
    """Seconds from the server's start until ServerReady (every model loaded)."""
    while True:
        if server.process.poll() is not None:
            server.exited()  # started again if it lost the race for its port, else raises
            continue
        try:
            if server.stub.ServerReady(pb.ServerReadyRequest(), timeout=2).ready:
                return time.monotonic() - started
        except grpc.RpcError:
            pass
        if time.monotonic() - started > READY_LIMIT_S:
            raise RuntimeError(f"not ready after {READY_LIMIT_S:.0f} s")
        time.sleep(0.2)


def measure(repository: Path, names: list[str], label: str, launcher: str) -> Row:
    logs = Path(tempfile.mkdtemp(prefix="bench-density-"))
    started = time.monotonic()
    server = ServerProcess(repository, logs / "server.log", ["--no-h3", *FLAGS[launcher]])
    try:
        ready_s = wait_ready(server, started)
        workers = [i.pid for name in names for i in server.instances(name)]
        uss = [memory_kb(pid)[0] / 1024 for pid in workers]
        root = server.process.pid
        pss = sum(memory_kb(pid)[1] for pid in (root, *descendants(root))) / 1024
        answered = 0
        inputs = RESNET_INPUTS if label.startswith("resnet18") else MLP_INPUTS
        for name in names if label != "examples" else ():  # every copy of mlp answers
            try:
                server.stub.ModelInfer(build_request(name, inputs), timeout=60)
                answered += 1
            except grpc.RpcError as exc:
                print(f"  {name}: {exc.code().name} {exc.details()}", file=sys.stderr)
    finally:
        server.stop()
        shutil.rmtree(logs, ignore_errors=True)
    count = len(names)
    median_uss = statistics.median(uss) if uss else 0.0
    return Row(
        label,
        count,
        launcher,
        round(ready_s, 1),
        len(workers),
        round(median_uss, 1),
        round(pss, 0),
        answered,
        median_uss <= 20.0,
        pss <= 25.0 * count + 300.0,
        ready_s <= 0.25 * count + 10.0,
    )


def measure_budget(root: Path, count: int, budget_mb: int) -> BudgetRow:
    repository, names = copies_of_mlp(root, count)
    logs = Path(tempfile.mkdtemp(prefix="bench-density-"))
    args = ["--no-h3", "--model-memory-budget", str(budget_mb)]
    server = ServerProcess(repository, logs / "server.log", args)
    try:
        wait_ready(server, time.monotonic())
        latencies, answered = [], 0
        for name in names:
            started = time.monotonic()
            try:
                server.stub.ModelInfer(build_request(name, MLP_INPUTS), timeout=120)
                answered += 1
            except grpc.RpcError as exc:
                print(f"  {name}: {exc.code().name} {exc.details()}", file=sys.stderr)
            latencies.append(time.monotonic() - started)
        started = time.monotonic()
        server.stub.ModelInfer(build_request(names[-1], MLP_INPUTS), timeout=120)
        resident_call = time.monotonic() - started
        index = server.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30).models
        tree = (server.process.pid, *descendants(server.process.pid))
        pss = sum(memory_kb(pid)[1] for pid in tree) / 1024
        counted = {
            name: int(sum(s.value for s in server.metrics() if s.name == name))
            for name in ("paddlequic_model_loads_total", "paddlequic_model_evictions_total")
        }
    finally:
        server.stop()
        shutil.rmtree(logs, ignore_errors=True)
    return BudgetRow(
        count,
        budget_mb,
        sum(m.state == "READY" for m in index),
        round(pss, 0),
        counted["paddlequic_model_loads_total"],
        counted["paddlequic_model_evictions_total"],
        answered,
        round(statistics.median(latencies), 3),
        round(max(latencies), 3),
        round(resident_call * 1e3, 1),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="copies of mlp")
    parser.add_argument("--no-examples", action="store_true", help="skip the example repository")
    parser.add_argument(
        "--instances", type=int, default=INSTANCES, help="resnet18's instance count; 0: skip"
    )
    parser.add_argument(
        "--budget-copies", type=int, default=60, help="copies of mlp under a budget; 0: skip"
    )
    parser.add_argument("--budget", type=int, default=200, help="--model-memory-budget, MB")
    args = parser.parse_args()
    rows: list[Row] = []
    budget_rows: list[BudgetRow] = []
    with tempfile.TemporaryDirectory(prefix="bench-density-") as scratch:
        plans: list[tuple[str, Path, list[str], tuple[str, ...]]] = []
        if not args.no_examples:
            examples = sorted(p.name for p in EXAMPLE_MODELS.iterdir() if p.is_dir())
            repo = model_repository(Path(scratch) / "examples", examples)
            plans.append(("examples", repo, examples, ("preloaded", "fresh")))
        for size in (int(s) for s in args.sizes.split(",") if s):
            repo, names = copies_of_mlp(Path(scratch) / f"mlp-x{size}", size)
            plans.append((f"mlp x {size}", repo, names, ("preloaded", "fresh")))
        if args.instances:
            repo, names = instances_of_resnet18(Path(scratch) / "resnet18", args.instances)
            plans.append((f"resnet18 x {args.instances}", repo, names, ("template", "preloaded")))
        for label, repo, names, launchers in plans:
            for launcher in launchers:
                if launcher == "fresh" and len(names) > FRESH_MAX_COPIES:
                    print(f"{label}, fresh: left out ({len(names)} x ~135 MB does not fit here)")
                    continue
                print(f"{label}, {launcher}: starting ...", flush=True)
                row = measure(repo, names, label, launcher)
                called = (
                    "not called" if label == "examples" else f"{row.answered}/{len(names)} answered"
                )
                print(f"  ready in {row.ready_s} s, {called}")
                rows.append(row)
        if args.budget_copies:
            print(f"mlp x {args.budget_copies} within {args.budget} MB: calling each ...")
            root = Path(scratch) / f"budget-x{args.budget_copies}"
            budget_rows.append(measure_budget(root, args.budget_copies, args.budget))
    print()
    header = (
        f"{'repository':<14}{'launcher':<11}{'ready s':>9}{'workers':>9}"
        f"{'median USS MB':>15}{'total PSS MB':>14}{'answered':>10}  goals (USS, PSS, READY)"
    )
    print(header)
    for r in rows:
        goals = " ".join("yes" if g else "NO" for g in (r.goal_uss, r.goal_pss, r.goal_ready))
        goals = goals if r.repository.startswith("mlp") else "-"  # the goals: N copies of mlp
        print(
            f"{r.repository:<14}{r.launcher:<11}{r.ready_s:>9}{r.workers:>9}"
            f"{r.median_worker_uss_mb:>15}{r.total_pss_mb:>14.0f}{r.answered:>10}  {goals}"
        )
    for b in budget_rows:
        print(
            f"\nmlp x {b.models} within --model-memory-budget {b.budget_mb} MB: "
            f"{b.answered}/{b.models} answered, {b.resident} resident at the end, total PSS "
            f"{b.total_pss_mb:.0f} MB, {b.loads} loads, {b.evictions} evictions; a call that "
            f"loads its model: median {b.first_call_median_s} s, at most {b.first_call_max_s} s; "
            f"a call to a resident model: {b.resident_call_ms} ms"
        )
    write_json(RESULTS, [*rows, *budget_rows])
    answered = all(r.answered == r.models or r.repository == "examples" for r in rows)
    return 0 if answered and all(b.answered == b.models for b in budget_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
