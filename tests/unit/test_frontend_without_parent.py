"""A front-end started when its parent's dispatch socket refuses it says why and exits 1 (its
supervisor starts another), instead of dying with a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from service.frontends.host_limits import ParentTally
from service.frontends.runtime import DISPATCH_SOCKET, write_settings
from service.settings import ServerSettings

WAIT_S = 60


def test_frontend_whose_parent_refuses_it_exits_with_the_reason(tmp_path: Path) -> None:
    write_settings(ServerSettings(), tmp_path)
    # A socket file nobody listens on: connecting is refused (ECONNREFUSED).
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / DISPATCH_SOCKET))
    stale.close()
    command = [sys.executable, "-m", "service.frontends.frontend", "--index", "3"]
    tally = ParentTally(ServerSettings(), 4)
    try:
        done = subprocess.run(
            [*command, "--runtime-dir", str(tmp_path), "--tally-fd", str(tally.fd)],
            capture_output=True,
            text=True,
            timeout=WAIT_S,
            pass_fds=(tally.fd,),
        )
    finally:
        tally.close()
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "front-end 3: cannot reach the parent" in done.stderr
    assert "Connection refused" in done.stderr
