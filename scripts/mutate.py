"""Mutation testing of the modules that carry security and data-integrity promises
(`make mutate`, `python -m scripts.mutate`).

Each module's mutants (scripts/mutations.py) are applied one at a time to a copy of the tree in
mutants/ (never to the tree itself), and each runs, with -x, only the fast unit tests of that
module that reached the mutated lines in an unmutated, traced run (all of them for lines run at
import). A mutant is killed when a test fails, survives when they all pass (or when no test
reaches its lines: "unreached"), and timed out when they run past a generous limit. Modules
with more mutants than --cap get a deterministic sample (seeded by the module's path). Prints a
table and writes bench-results/mutate.json with every survivor.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.bench_common import write_json
from scripts.mutations import Mutant, mutants

ROOT = Path(__file__).resolve().parents[1]
COPY = ROOT / "mutants"
COPIED = ("service", "transport", "oip", "clients", "protos", "tests", "scripts", "pyproject.toml")
LINKED = ("models", "certs")

_TICKET_TESTS = (
    "tests/unit/test_shared_tickets.py",
    "tests/unit/test_sqlite_tickets.py",
    "tests/unit/test_client_auth.py",
    "tests/unit/test_sqlite_ticket_links.py",
    "tests/unit/test_sqlite_ticket_counters.py",
)
# Module -> its fast unit tests (e2e tests are too slow to run once per mutant). A new module
# is one row here: its path and the unit tests that exercise it; `--module PATH=TEST,...` runs
# one without a row. tests/unit/test_mutate_modules.py checks every path exists.
MODULES: dict[str, tuple[str, ...]] = {
    "service/api/restricted.py": ("tests/unit/test_restricted.py",),
    "service/resilience/poison.py": (
        "tests/unit/test_batching.py",
        "tests/unit/test_poison_list.py",
    ),
    "transport/tls/session_tickets.py": (
        "tests/unit/test_tickets.py",
        "tests/unit/test_client_auth.py",
        "tests/unit/test_shared_tickets.py",
        "tests/unit/test_ticket_store_bounds.py",
    ),
    "transport/h3/aioquic/credit.py": (
        "tests/unit/test_receive_credit.py",
        "tests/unit/test_receive_credit_accounting.py",
        "tests/unit/test_receive_credit_peers.py",
    ),
    "service/batching/assemble.py": (
        "tests/unit/test_batching.py",
        "tests/unit/test_shapes.py",
        "tests/unit/test_bytes_tensors.py",
        "tests/unit/test_assemble_mutants.py",
    ),
    "service/tickets/seal.py": _TICKET_TESTS,
    "service/tickets/sqlite_store.py": _TICKET_TESTS,
    "service/tickets/redis_store.py": _TICKET_TESTS,
    "service/tickets/store.py": _TICKET_TESTS,
    "service/tickets/outage.py": _TICKET_TESTS,
    "service/lifecycle/signing.py": ("tests/unit/test_signing.py",),
    "service/lifecycle/verified_copies.py": ("tests/unit/test_verified_copies.py",),
    # Not test_decoding_cost.py: it counts allocations with tracemalloc, and the traced run's
    # line tracer allocates too.
    "service/inference/validation.py": (
        "tests/unit/test_validation.py",
        "tests/unit/test_bytes_tensors.py",
    ),
    # A model's BLS calls: the wait-for graph that refuses a call waiting for itself, and the
    # watchdog's count of a batch's computing around its calls.
    "service/inference/waits.py": ("tests/unit/test_wait_graph.py",),
    "service/workers/watchdog.py": ("tests/unit/test_watchdog_clock.py",),
    # The bounds of the second outside review (issues 41 and 42).
    "service/workers/message_bounds.py": ("tests/unit/test_message_bounds.py",),
    "service/workers/model_output.py": ("tests/unit/test_model_output.py",),
    "transport/h3/receive_budget.py": (
        "tests/unit/test_receive_budget.py",
        "tests/unit/test_settings.py",
    ),
    "service/inference/object_access.py": ("tests/unit/test_object_access.py",),
    "service/api/stream_outbox.py": ("tests/unit/test_stream_outbox.py",),
    "service/batching/concurrency.py": ("tests/unit/test_decoupled_bookkeeping.py",),
    "service/batching/sequence_queue.py": (
        "tests/unit/test_sequence_queue.py",
        "tests/unit/test_sequence_owners.py",
    ),
}
DEFAULT_CAP = 25
PYTEST = (
    "-m",
    "pytest",
    "-q",
    "-x",
    "--no-header",
    "-p",
    "no:cacheprovider",
    "-p",
    "scripts.mutate_plugin",
)


@dataclass
class Survivor:
    line: int
    description: str
    code: str
    unreached: bool


@dataclass
class ModuleResult:
    module: str
    tests: list[str]
    total: int = 0
    mutants: int = 0
    killed: int = 0
    survived: int = 0
    unreached: int = 0
    timed_out: int = 0
    seconds: float = 0.0
    survivors: list[Survivor] = field(default_factory=list)


@dataclass
class Coverage:
    """Lines of the module each test ran ("": outside any test), and each test's seconds."""

    lines: dict[str, set[int]]
    durations: dict[str, float]

    def tests_for(self, mutant: Mutant) -> list[str] | None:
        """The tests that reach the mutant (None: its lines run at import, so every test)."""
        span = set(range(mutant.line, mutant.end_line + 1))
        if span & self.lines.get("", set()):
            return None
        return [test for test, hit in self.lines.items() if test and span & hit]

    def seconds(self, tests: list[str] | None) -> float:
        """How long `tests` took unmutated (traced, so slower than a mutant's run)."""
        chosen = self.durations if tests is None else tests
        return sum(self.durations.get(test, 1.0) for test in chosen)


def make_copy() -> None:
    """mutants/: a fresh copy of the tree's code and tests, the only place mutants are written."""
    if COPY.is_symlink() or COPY.resolve().parent != ROOT:
        raise SystemExit(f"{COPY} must be a plain directory inside {ROOT}")
    shutil.rmtree(COPY, ignore_errors=True)
    COPY.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.egg-info")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, COPY / name, ignore=ignore)
        else:
            shutil.copy2(source, COPY / name)
    for name in LINKED:
        if (ROOT / name).exists():
            (COPY / name).symlink_to((ROOT / name).resolve())


def run_tests(tests: list[str], timeout: float, env: dict[str, str]) -> str:
    """'passed', 'failed' or 'timeout': the tests run in the copy, as their own process group."""
    process = subprocess.Popen(
        [sys.executable, *PYTEST, *tests],
        cwd=COPY,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the group is alive: its leader is not reaped
        process.wait()
        return "timeout"
    return "passed" if code == 0 else "failed"


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUTATE_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant must never run from a stale .pyc
    env.pop("PYTHONPATH", None)
    return env


def trace(module: str, tests: list[str]) -> Coverage:
    """The unmutated run: every test must pass; records which test reaches which line."""
    target = COPY / module
    out = COPY / "trace.json"
    env = base_env() | {"MUTATE_TRACE_FILE": str(target.resolve()), "MUTATE_TRACE_OUT": str(out)}
    outcome = run_tests(tests, 1800, env)
    if outcome != "passed":
        raise SystemExit(f"{module}: the unmutated tests did not pass ({outcome}): {tests}")
    data = json.loads(out.read_text())
    lines = {test: set(hit) for test, hit in data["lines"].items()}
    for test, reason in data["skipped"].items():
        print(f"  SKIPPED {test} ({reason}): the lines only it reaches count as unreached")
    if not lines:
        print(f"  no test ran any line of {module}: every mutant is unreached")
    return Coverage(lines, data["durations"])


def sample(module: str, found: list[Mutant], cap: int) -> list[Mutant]:
    if cap <= 0 or len(found) <= cap:
        return found
    chosen = random.Random(module).sample(range(len(found)), cap)
    return [found[i] for i in sorted(chosen)]


def previous_survivors(path: Path) -> dict[str, set[tuple[int, str]]]:
    """Module -> (line, description) of each mutant that survived in an earlier report."""
    return {
        row["module"]: {(s["line"], s["description"]) for s in row["survivors"]}
        for row in json.loads(path.read_text())
    }


def module_table(extra: list[str]) -> dict[str, tuple[str, ...]]:
    """MODULES with the `--module PATH=TEST[,TEST...]` rows added (a listed module's tests
    replaced); SystemExit naming any path that does not exist, so a misspelt row is never
    run with fewer tests than it names."""
    rows = dict(MODULES)
    for row in extra:
        module, _, tests = row.partition("=")
        rows[module] = tuple(t for t in tests.split(",") if t)
        if not rows[module]:
            raise SystemExit(f"--module {row!r}: expected PATH=TEST[,TEST...]")
    missing = [
        path
        for module, tests in rows.items()
        for path in (module, *tests)
        if not (ROOT / path).is_file()
    ]
    if missing:
        raise SystemExit(f"not found in {ROOT}: {' '.join(sorted(set(missing)))}")
    return rows


def mutate_module(
    module: str, tests: list[str], cap: int, only: set[tuple[int, str]] | None
) -> ModuleResult:
    result = ModuleResult(module, tests)
    started = time.monotonic()
    target = COPY / module
    original = target.read_bytes()
    source_lines = original.decode().splitlines()
    found = mutants(original)
    chosen = sample(module, found, cap)
    if only is not None:
        chosen = [m for m in chosen if (m.line, m.description) in only]
    result.total, result.mutants = len(found), len(chosen)
    print(f"== {module}: {len(chosen)} of {len(found)} mutants; tests: {' '.join(tests)}")
    coverage = trace(module, tests)
    env = base_env()
    for number, mutant in enumerate(chosen, 1):
        selected = coverage.tests_for(mutant)
        outcome = "unreached"
        if selected != []:
            run = tests if selected is None else selected
            target.write_bytes(mutant.apply(original))
            try:
                outcome = run_tests(run, 20 + 2 * coverage.seconds(selected), env)
            finally:
                target.write_bytes(original)
        if outcome == "failed":
            result.killed += 1
        elif outcome == "timeout":
            result.timed_out += 1
        else:
            result.survived += 1
            result.unreached += outcome == "unreached"
            code = source_lines[mutant.line - 1].strip()
            survivor = Survivor(mutant.line, mutant.description, code, outcome == "unreached")
            result.survivors.append(survivor)
        label = {"failed": "killed", "passed": "SURVIVED"}.get(outcome, outcome)
        print(f"  [{number}/{len(chosen)}] {label:9} line {mutant.line}: {mutant.description}")
        sys.stdout.flush()
    result.seconds = round(time.monotonic() - started, 1)
    return result


def table(results: list[ModuleResult]) -> str:
    header = ("module", "mutants", "killed", "survived", "(unreached)", "timed out", "s")
    rows: list[tuple[str, ...]] = [header]
    for r in results:
        mutants_text = f"{r.mutants}/{r.total}" if r.mutants < r.total else str(r.mutants)
        counts = (r.killed, r.survived, r.unreached, r.timed_out, round(r.seconds))
        rows.append((r.module, mutants_text, *map(str, counts)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated substrings of module paths")
    parser.add_argument(
        "--cap", type=int, default=DEFAULT_CAP, help="mutants per module, sampled (0: all)"
    )
    parser.add_argument(
        "--survivors-of",
        type=Path,
        help="an earlier report: run only the mutants that survived there (after adding tests)",
    )
    parser.add_argument(
        "--module",
        action="append",
        default=[],
        metavar="PATH=TEST[,TEST...]",
        help="a module and its unit tests, listed in MODULES or not (repeatable); "
        "without --only, only these run",
    )
    parser.add_argument("--list", action="store_true", help="print the modules and their tests")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "mutate.json")
    args = parser.parse_args()
    listed = module_table(args.module)
    if args.list:
        for module, tests in listed.items():
            print(f"{module}: {' '.join(tests)}")
        return
    wanted = [w for w in args.only.split(",") if w]
    if not wanted and args.module:
        wanted = [row.partition("=")[0] for row in args.module]
    modules = [m for m in listed if not wanted or any(w in m for w in wanted)]
    earlier = previous_survivors(args.survivors_of) if args.survivors_of else None
    if earlier is not None:
        modules = [m for m in modules if m in earlier]
    make_copy()
    results = [
        mutate_module(
            module, list(listed[module]), args.cap, None if earlier is None else earlier[module]
        )
        for module in modules
    ]
    print()
    print(table(results))
    for r in results:
        for s in r.survivors:
            reason = " (no test reaches it)" if s.unreached else ""
            print(f"  {r.module}:{s.line}: {s.description}{reason}: {s.code}")
    write_json(args.out, [asdict(r) for r in results])


if __name__ == "__main__":
    main()
