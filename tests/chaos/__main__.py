"""`python -m tests.chaos`: every attack against a live server (the rows marked --frontends 2
against a second one with two front-end processes), a table, JSON; exit status 1 when any row
misses the goal."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from tests.chaos.harness import (
    FULL,
    GOAL_RSS_MB,
    RETRY_BACKOFF_S,
    SHORT,
    Row,
    attacker_process,
    chaos_server,
    run_row,
)
from tests.chaos.registry import ATTACKS

COLUMNS = ("attack", "good requests", "good failures", "RSS growth MB", "attacker got", "goal")


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key} x{value}" for key, value in sorted(counts.items())) or "-"


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for row in rows:
        retried = f" (retried once: {_counts(row.good_retried)})" if row.good_retried else ""
        cells = (
            row.attack,
            str(row.good_requests),
            _counts(row.good_failures) + retried,
            f"{row.rss_growth_mb:.1f}",
            _counts(row.attacker),
            "pass" if row.passed else "FAIL: " + "; ".join(row.misses()),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--short", action="store_true", help="the small sizes pytest uses")
    parser.add_argument("--only", default="", help="run attacks whose name contains this")
    parser.add_argument("--json", type=Path, default=Path("bench-results/chaos.json"))
    args = parser.parse_args(argv)
    # aioquic logs every connection at INFO once Paddle (imported for reference outputs) has
    # configured the root logger; thousands of attack connections would drown the table.
    logging.getLogger("quic").setLevel(logging.WARNING)
    scale = SHORT if args.short else FULL
    attacks = [a for a in ATTACKS if args.only.lower() in a.name.lower()]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="chaos-") as directory:
        for frontends, batcher in sorted({(a.frontends, a.batcher) for a in attacks}):
            chosen = [a for a in attacks if (a.frontends, a.batcher) == (frontends, batcher)]
            print(
                f"starting the server with --frontends {frontends}"
                f"{' --no-instance-queues' if batcher else ''} ({scale.name} sizes, "
                f"{len(chosen)} attacks)",
                flush=True,
            )
            with (
                chaos_server(Path(directory), frontends, batcher) as (server, target),
                attacker_process() as pool,
            ):
                for spec in chosen:
                    print(f"  {spec.name} ...", end="", flush=True)
                    row = asyncio.run(run_row(server, target, spec, scale, pool))
                    rows.append(row)
                    verdict = "pass" if row.passed else "FAIL"
                    print(f" {verdict} ({row.seconds:.0f} s)", flush=True)
    print()
    print(
        f"goal: zero failed good requests, front-end RSS growth < {GOAL_RSS_MB:.0f} MB, "
        "every attacking request answered with a clear status or refused at the transport"
    )
    if any(row.good_retried for row in rows):
        print(
            f"retried once after {RETRY_BACKOFF_S} s, only a failed retry counting: a good call "
            "failing UNAVAILABLE where a front-end is SIGKILLed (its connection's process), and "
            "a REST request never sent (its kept-alive connection closing as it was reused)"
        )
    print(table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "scale": scale.name,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "goal_rss_mb": GOAL_RSS_MB,
        "rows": [row.as_json() for row in rows],
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0 if rows and all(row.passed for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
