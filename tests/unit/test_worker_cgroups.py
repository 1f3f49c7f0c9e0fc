"""How the server decides whether workers get cgroups, and what it writes for one, on a cgroup
tree laid out as the kernel shows it (files in a temporary directory: this test must not move
the test process into another cgroup, which detect() does on a host that offers them). The
e2e test (test_worker_processes.py) checks what a real server says on this host."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.workers import cgroups

CGROUP2_LINE = (
    "35 24 0:30 / {mount} rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw\n"
)
PROC_LINE = "22 26 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw\n"


def host(tmp_path: Path, controllers: str, own: str = "0::/service\n") -> tuple[Path, Path, Path]:
    """(mountinfo, /proc/self/cgroup, the server's cgroup directory) of a fake host."""
    mount = tmp_path / "cgroup"
    base = mount / "service"
    base.mkdir(parents=True)
    (base / "cgroup.controllers").write_text(controllers)
    (base / "cgroup.subtree_control").write_text("")
    (base / "cgroup.procs").write_text(f"{os.getpid()}\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(PROC_LINE + CGROUP2_LINE.format(mount=mount))
    own_cgroup = tmp_path / "cgroup-of-self"
    own_cgroup.write_text(own)
    return mountinfo, own_cgroup, base


def test_a_delegated_cgroup_gets_a_server_leaf_and_one_cgroup_per_worker(tmp_path: Path) -> None:
    mountinfo, own, base = host(tmp_path, "cpuset cpu io memory pids\n")
    found = cgroups.detect(mountinfo, own)
    assert (found.parent, found.unavailable) == (base, "")
    assert (base / cgroups.SERVER_LEAF / "cgroup.procs").read_text() == str(os.getpid())
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids"
    first = found.create("mlp_1_cpu0", 1 << 30)
    second = found.create("mlp_1_cpu0", None)
    assert first is not None and second is not None and first != second
    assert first.parent == base and "mlp_1_cpu0" in first.name
    assert (first / "memory.max").read_text() == str(1 << 30)
    assert (second / "memory.max").read_text() == "max"  # a Paddle model without memory_mb
    assert (first / "pids.max").read_text() == str(cgroups.MAX_WORKER_TASKS)
    for made in (first, second):
        for name in ("memory.max", "pids.max"):
            (made / name).unlink()  # a real cgroup's files go with it
        cgroups.WorkerCgroups.remove(made)
        assert not made.exists()


@pytest.mark.parametrize(
    ("controllers", "own", "why"),
    [
        ("hugetlb\n", "0::/service\n", "offers no memory or pids controller"),
        ("memory\n", "0::/service\n", "offers no pids controller"),
        ("memory pids\n", "4:memory:/x\n1:cpu:/\n", "in no cgroup v2 (only v1 hierarchies)"),
    ],
)
def test_a_host_without_them_says_why(tmp_path: Path, controllers: str, own: str, why: str) -> None:
    mountinfo, own_cgroup, base = host(tmp_path, controllers, own)
    found = cgroups.detect(mountinfo, own_cgroup)
    assert found.parent is None and why in found.unavailable
    assert found.create("mlp_1_cpu0", 1 << 30) is None
    assert not (base / cgroups.SERVER_LEAF).exists()


def test_no_cgroup2_mount(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(PROC_LINE)
    found = cgroups.detect(mountinfo, tmp_path / "unread")
    assert (found.parent, found.unavailable) == (None, "no cgroup2 file system is mounted")
