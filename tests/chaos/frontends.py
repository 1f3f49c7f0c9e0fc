"""Attacks on the front-end processes of a `--frontends` server: SIGKILL under load."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request
from pathlib import Path

from tests.chaos.harness import AttackResult, Scale, Target, frontend_pids
from tests.chaos.workers import RESTART_LIMIT_S, instances

RESTARTS = re.compile(r"^paddlequic_frontend_restarts_total (\S+)$", re.M)
POLL_S = 0.05
# /proc/net socket states (include/net/tcp_states.h): a listening TCP socket, a bound UDP one.
TCP_LISTEN = "0A"
UDP_BOUND = "07"


def _serving(pid: int, port: int) -> bool:
    """Whether the process holds a TCP socket listening on `port` and a UDP socket bound to
    it: a new front-end that has not got both yet would refuse the clients sent to it."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    return all(
        any(
            _holds(Path(f"/proc/{pid}/net/{table}"), port, state, inodes)
            for table in (kind, f"{kind}6")
        )
        for kind, state in (("tcp", TCP_LISTEN), ("udp", UDP_BOUND))
    )


def _holds(table: Path, port: int, state: str, inodes: set[str]) -> bool:
    for line in table.read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].rsplit(":", 1)[1], 16)
        if local_port == port and fields[3] == state and fields[9] in inodes:
            return True
    return False


def frontend_restarts(target: Target) -> float:
    with urllib.request.urlopen(target.metrics_url, timeout=10) as response:
        found = RESTARTS.search(response.read().decode())
    return float(found.group(1)) if found else 0.0


async def _replaced(target: Target, victim: int, count: int, restarts: float) -> bool:
    """Until `count` front-ends serve again, the victim not among them, and /metrics counted
    the restart (bounded)."""
    deadline = time.monotonic() + RESTART_LIMIT_S
    while time.monotonic() < deadline:
        try:
            running = frontend_pids(target.pid)
            back = len(running) == count and victim not in running
            back = back and all(_serving(pid, target.port) for pid in running)
        except OSError:  # a process that just started or exited
            back = False
        if back and await asyncio.to_thread(frontend_restarts, target) > restarts:
            return True
        await asyncio.sleep(POLL_S)
    return False


async def frontend_sigkill(target: Target, scale: Scale) -> AttackResult:
    """SIGKILL a front-end process while good clients call through both, wait for the
    parent to start a new one, repeat; the model workers (the parent's) must not restart."""
    result = AttackResult()
    workers = {(i.name, i.pid, i.restarts) for i in await instances(target)}
    count = len(frontend_pids(target.pid))
    if count < 2:
        result.problems.append(f"{count} front-end processes: the server has no --frontends")
        return result
    for kill in range(scale.frontend_kills):
        if kill:
            await asyncio.sleep(scale.frontend_kill_gap_s)
        victim = min(frontend_pids(target.pid))  # the oldest: a new one gets a higher pid
        restarts = await asyncio.to_thread(frontend_restarts, target)
        os.kill(victim, signal.SIGKILL)
        result.outcomes["killed"] += 1
        if await _replaced(target, victim, count, restarts):
            result.outcomes["replaced"] += 1
        else:
            result.problems.append(f"front-end {victim} not replaced within {RESTART_LIMIT_S} s")
    result.notes["frontend_restarts"] = await asyncio.to_thread(frontend_restarts, target)
    after = {(i.name, i.pid, i.restarts) for i in await instances(target)}
    if after != workers:
        result.problems.append(f"model workers changed: {sorted(workers)} -> {sorted(after)}")
    return result
