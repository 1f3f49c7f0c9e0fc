"""A client whose address changes mid-call keeps its calls: a NAT rebinding (new port) and a
move to another address, each many times while unary calls and a streaming call run, with
`--frontends 1` and `2`. No call fails or outlives its deadline, the connection is never
replaced, and with two front-ends some datagrams from a new address reached the front-end that
does not own the connection and were passed on. Needs root, `ip netns` and /dev/net/tun;
skipped elsewhere."""

from __future__ import annotations

import subprocess

import pytest

from scripts.migration_lab import run_lab
from scripts.rtt_lab import _preflight

pytestmark = pytest.mark.e2e

# With two front-ends each new address lands on the owner's socket or the other's at random:
# the chance that none of MOVES reaches the other is 2^-MOVES.
MOVES = 12


def test_calls_survive_address_changes_with_one_and_two_frontends() -> None:
    problem = _preflight()
    if problem is not None:
        pytest.skip(problem)
    rows = run_lab(("rebind", "move"), (1, 2), (0.0,), MOVES, every_s=0.15)
    assert [(r.scenario, r.frontends) for r in rows] == [
        ("rebind", 1),
        ("move", 1),
        ("rebind", 2),
        ("move", 2),
    ]
    for r in rows:
        assert (r.moves, r.lost, r.errors, r.kept_connection) == (MOVES, 0, [], True), r
        assert r.across > 0 and r.stream_messages > 0, r  # calls were in flight at the moves
    # Datagrams passed between the two front-ends: in the run, not in each row, since moves
    # that land while the client waits in silence (it sends nothing until its PING, 0.25 s
    # later, from whatever address it has then) can leave one scenario with nothing to forward.
    assert sum(r.forwarded_datagrams for r in rows if r.frontends == 2) > 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "pqmig-" not in listed
