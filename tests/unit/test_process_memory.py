"""Large buffers freed in a server process go back to the system (service/process_memory.py):
a body grown in chunks to 16 MiB and freed, four times over, leaves the process's resident
memory where it was. Without it (glibc's adaptive threshold) the same process keeps about
18 MiB: the body's size, in the heap."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.servers import REPO_ROOT

GROW = """
import json, sys
from service.process_memory import release_large_buffers

def rss_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

fixed = release_large_buffers() if sys.argv[1] == "fixed" else False
before = rss_mib()
for _ in range(4):
    body = bytearray()
    for _ in range(16):
        body += b"x" * (1 << 20)
    del body
print(json.dumps({"fixed": fixed, "kept_mib": rss_mib() - before}))
"""


def kept(mode: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", GROW, mode],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        check=True,
    )
    result: dict[str, float] = json.loads(done.stdout)
    return result


def test_a_freed_body_leaves_no_memory_behind() -> None:
    fixed = kept("fixed")
    assert fixed["fixed"] is True  # the server's hosts run glibc
    assert fixed["kept_mib"] < 4
