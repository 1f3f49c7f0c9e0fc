"""An auto:// client on a real link whose UDP is dropped: its calls fall back to HTTP/2 within a
second and keep working; when UDP comes back it moves to HTTP/3 once the remembered failure
expired, and stays there. Nothing is left behind. Needs root, `ip netns` and /dev/net/tun;
skipped elsewhere."""

from __future__ import annotations

import subprocess

import pytest

from scripts.udp_fallback_lab import EXPECTED, run_lab
from tests.lab.test_link import _skip_unless_lab_can_run
from tests.servers import EXAMPLE_MODELS

pytestmark = pytest.mark.e2e


def test_falls_back_when_udp_is_dropped_and_returns_when_it_is_not() -> None:
    _skip_unless_lab_can_run()
    if not (EXAMPLE_MODELS / "mlp").is_dir():
        pytest.skip(f"the example model {EXAMPLE_MODELS / 'mlp'} is missing: run `make models`")
    result = run_lab(EXAMPLE_MODELS)
    assert {step: result[step] for step in EXPECTED} == EXPECTED
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "pqudp-" not in listed
