"""`make bench-scale`'s tables (scripts/bench_scale.py): a ratio is taken within each round,
against the first server of that round, and the table gives its median and range."""

from __future__ import annotations

import dataclasses

from scripts.bench_scale import Measurement, Setup, cpu_table, projection_table, table

ONE, TWO = Setup(1, "queues"), Setup(2, "queues")


def measured(round_: int, setup: Setup, per_second: float, total_us: float) -> list[Measurement]:
    """The same figures for every transport and workload of a round."""
    return [
        Measurement(
            round_, "mlp", setup.frontends, setup.path, transport, workload, 100, 1.0,
            per_second, 1.0, total_us - 1.0, 0.0, total_us, 10.0, "workers",
            {"16": int(per_second), "64": 4 * int(per_second)},
        )
        for transport in ("h2", "h3")
        for workload in ("ModelInfer", "new connections")
    ]  # fmt: skip


def test_ratios_are_taken_within_rounds_then_their_median_and_range_given() -> None:
    # Round 0: the second server costs 1.1x the first; round 1, on a slower moment: 0.9x.
    results = [
        *measured(0, ONE, 1000, 100),
        *measured(0, TWO, 900, 110),
        *measured(1, TWO, 600, 180),
        *measured(1, ONE, 500, 200),
    ]
    cpu = cpu_table(results, [ONE, TWO])
    # The medians of the figures are 150 and 145 (their ratio 0.97x); of the ratios, 1.00x.
    assert "145 (1.00x (0.90-1.10)) main 1" in cpu
    assert "150 (1.00x (1.00-1.00)) main 1" in cpu
    assert "750 (1.05x (0.90-1.20))" in table(results, [ONE, TWO])
    assert "750/3000 (workers)" in projection_table(results, [ONE, TWO])


def test_a_row_per_workload_measured_and_none_for_the_others() -> None:
    results = [
        m
        for m in [*measured(0, ONE, 1000, 100), *measured(0, TWO, 900, 110)]
        if m.workload == "ModelInfer"
    ]
    results += [dataclasses.replace(m, workload="ModelStreamInfer") for m in results]
    rows = table(results, [ONE, TWO]).splitlines()
    assert [row.split()[:2] for row in rows[2:]] == [
        ["ModelInfer", "h2"],
        ["ModelInfer", "h3"],
        ["ModelStreamInfer", "h2"],
        ["ModelStreamInfer", "h3"],
    ]
