"""Linux cpulist strings ("0-31,64-95", as in /sys/devices/system/node/node0/cpulist) <-> sets."""

from __future__ import annotations

from collections.abc import Iterable


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse a cpulist: comma-separated CPU numbers and inclusive ranges; empty -> no CPUs."""
    cpus: set[int] = set()
    for raw in text.strip().split(","):
        part = raw.strip()
        if not part:
            continue
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"bad cpulist entry {part!r} in {text.strip()!r}")
        low, high = int(first), int(last) if sep else int(first)
        if high < low:
            raise ValueError(f"bad cpulist range {part!r}: end before start")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The shortest cpulist for a set of CPUs: sorted, consecutive runs as ranges."""
    ranges: list[str] = []
    run_start = previous = -2
    for cpu in sorted(set(cpus)):
        if cpu != previous + 1:
            if previous >= 0:
                ranges.append(_run(run_start, previous))
            run_start = cpu
        previous = cpu
    if previous >= 0:
        ranges.append(_run(run_start, previous))
    return ",".join(ranges)


def _run(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


# The CPUs placement chose for a worker, as a Linux cpulist; applied before paddle is imported.
CPU_AFFINITY_ENV = "PADDLEQUIC_CPU_AFFINITY"
