"""A root worker's change of user, in a child process of its own (it cannot be undone): the
check judges readability as the kernel does for that user, and after the change no uid, group
or capability of root is left. The e2e test (test_python_sandbox.py) covers the worker; on
this kind of host it may stay uid 0 (an interpreter under /root), which this test does not."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.servers import REPO_ROOT

NOBODY = 65534
CHILD = """
import os, sys
from pathlib import Path
from service.backend.sandbox import privileges

readable, private = Path(sys.argv[1]), Path(sys.argv[2])
print(privileges.unreadable_as(NOBODY, NOBODY, [readable, private]))
print(privileges.unreadable_as(NOBODY, NOBODY, [readable]))
privileges.drop_bounding_set()
privileges.become(NOBODY, NOBODY)
privileges.drop_capabilities()
print(os.getresuid(), os.getresgid(), os.getgroups())
status = Path("/proc/self/status").read_text().splitlines()
print(" ".join(line.split()[1] for line in status if line.startswith(("CapEff", "CapBnd"))))
try:
    (private / "secret").read_text()
    print("read")
except PermissionError:
    print("denied")
""".replace("NOBODY", str(NOBODY))


@pytest.mark.skipif(os.geteuid() != 0, reason="changing user needs root")
def test_root_becomes_nobody_without_capabilities() -> None:
    # Not pytest's tmp_path: its parents are private to root.
    with tempfile.TemporaryDirectory() as directory:
        check_change_of_user(Path(directory))


def check_change_of_user(root: Path) -> None:
    root.chmod(0o711)
    readable = root / "readable"
    private = root / "private"
    readable.mkdir(mode=0o755)
    private.mkdir(mode=0o700)
    (private / "secret").write_text("root's")
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(readable), str(private)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert result.stdout.splitlines() == [
        str(private),
        "None",
        f"({NOBODY}, {NOBODY}, {NOBODY}) ({NOBODY}, {NOBODY}, {NOBODY}) []",
        "0000000000000000 0000000000000000",
        "denied",
    ]
