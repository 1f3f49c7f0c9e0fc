"""`make bench-generate`'s table from measurements made up for it: the served runs' CPU per
token, the parent's beside the whole server's (--frontends N), and the goal ratios taken
within each round."""

from __future__ import annotations

from scripts.bench_generate import CONCURRENCY, ENGINE_RUNS, RUNS, Measurement, table


def measurements(rounds: int) -> list[Measurement]:
    made = []
    for round_ in range(1, rounds + 1):
        for way, transport in (*RUNS, *ENGINE_RUNS):
            for concurrency in CONCURRENCY:
                served = transport != "engine"
                made.append(
                    Measurement(
                        round_,
                        way,
                        transport,
                        concurrency,
                        10,
                        100 * round_,
                        1.0,
                        100.0 * round_ * (2 if way == "iteration" else 1),
                        10.0,
                        20.0,
                        server_us_per_token=120.0 + round_ if served else None,
                        worker_us_per_token=300.0 if served else None,
                        parent_us_per_token=70.0 + round_ if served else None,
                    )
                )
    return made


def test_the_parent_s_cpu_per_token_has_its_own_column() -> None:
    lines = table(measurements(3)).splitlines()
    assert "of which the parent's" in lines[2]
    served = next(line for line in lines if line.startswith("| iteration | h2 | 32 |"))
    cells = [cell.strip() for cell in served.strip("|").split("|")]
    # server, parent, worker: medians [lowest-highest] over the rounds
    assert cells[6:9] == ["122 [121-123]", "72 [71-73]", "300 [300-300]"]
    engine = next(line for line in lines if line.startswith("| iteration | engine | 32 |"))
    assert engine.rstrip().endswith("| - | - | - |")


def test_ratios_are_taken_within_rounds() -> None:
    text = table(measurements(3))
    ratio = next(line for line in text.splitlines() if "server / worker CPU" in line)
    # (120 + r) / 300 for r = 1, 2, 3
    assert ratio.rstrip().endswith("| 0.41 [0.40-0.41] |")
