"""A server or front-end that checks no signatures and keeps no tickets in Redis starts without
importing model-signing or redis-py: together they were 0.6 s of every process's 1.6 s start
(`python -X importtime -c "import service.server"`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.servers import REPO_ROOT

ONLY_WHEN_USED = ("model_signing", "sigstore", "redis")


@pytest.mark.parametrize("module", ["service.server", "service.frontends.frontend"])
def test_a_process_imports_signing_and_redis_only_when_it_uses_them(module: str) -> None:
    probe = (
        f"import sys, {module}\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {ONLY_WHEN_USED!r}))"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert found == "[]"
