"""The two-replica lab: a ticket replica A issued is accepted once by replica B, across real
network namespaces and a real Redis, and refused on every later try on either; nothing is left
behind. Needs root, `ip netns` and redis-server; skipped elsewhere."""

from __future__ import annotations

import subprocess

import pytest

from scripts.replica_lab import EXPECTED, Lan, preflight, run_lab
from tests.servers import EXAMPLE_MODELS

pytestmark = pytest.mark.e2e


def test_a_ticket_from_one_replica_is_redeemed_once_on_the_other() -> None:
    problem = preflight()
    if problem is not None:
        pytest.skip(problem)
    assert run_lab(EXAMPLE_MODELS) == EXPECTED
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in Lan().namespaces.values())
