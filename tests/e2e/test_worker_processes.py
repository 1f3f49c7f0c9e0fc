"""A worker's processes and memory on a real server: a hostile model.py
(tests/fixtures/python_processes) tries each attack of the outside review with processes. By
default a sandboxed model starts none (seccomp), holds at most 16 MiB in a memfd file
(RLIMIT_FSIZE), creates no namespace through clone and reads neither its network's sockets nor
the host's mounts in /proc; with `python_child_processes` it may start that many, no more (the
worker is then killed and its request fails with RESOURCE_EXHAUSTED, not retried), and none
outlives the worker, a double fork and setsid included, after a crash or a clean stop. What is
in force without a cgroup per worker (this host may have none) is named at load and in
ListInstances."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from service.backend.sandbox import landlock, seccomp
from tests.servers import ServerProcess, alive, eventually, running_server

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "python_processes"
TIMEOUT_S = 60.0
CHILDREN = 4
MEMFD_MAX_MB = 16
CGROUP_MISSING = "this host lacks a worker protection: a cgroup of its own"

pytestmark = pytest.mark.skipif(not seccomp.supported(), reason="no seccomp filter here")


def processes_model(repository: Path, name: str, children: int | None) -> None:
    shutil.copytree(FIXTURE, repository / name)
    config = (FIXTURE / "config.pbtxt").read_text().replace('"processes"', f'"{name}"')
    if children is not None:
        value = f'{{ string_value: "{children}" }}'
        config += f'parameters {{ key: "python_child_processes" value: {value} }}\n'
    (repository / name / "config.pbtxt").write_text(config)


def serve(root: Path) -> Iterator[ServerProcess]:
    repository = root / "models"
    repository.mkdir()
    processes_model(repository, "hostile", None)
    processes_model(repository, "forking", CHILDREN)
    processes_model(repository, "spawner", None)
    with (repository / "spawner" / "config.pbtxt").open("a") as config:
        config.write('parameters { key: "spawn_at_load" value: { string_value: "1" } }\n')
    args = ["--testing-service"]
    with running_server(repository, root / "server.log", args, wait=False) as server:
        server.wait_loaded()  # spawner fails to load: ServerReady stays false
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve(tmp_path_factory.mktemp("processes"))


def attack(server: ServerProcess, model: str, **probe: object) -> dict[str, str]:
    text = np.array([json.dumps(probe).encode()], dtype=np.object_)
    response = server.stub.ModelInfer(build_request(model, {"probe": text}), timeout=TIMEOUT_S)
    (report,) = parse_response(response)["report"].tolist()
    result: dict[str, str] = json.loads(report)
    return result


def test_a_model_starts_no_process_by_default(server: ServerProcess) -> None:
    assert attack(server, "hostile", attack="fork bomb") == {
        "forks": "0",
        "error": "PermissionError",
    }
    assert attack(server, "hostile", attack="forked memory") == {"forked memory": "PermissionError"}
    assert attack(server, "hostile", attack="popen") == {"popen": "PermissionError"}


def test_a_memfd_file_holds_at_most_its_bound(server: ServerProcess) -> None:
    """1,500 MiB asked for: RLIMIT_FSIZE stops it at 16 MiB with EFBIG (27)."""
    report = attack(server, "hostile", attack="memfd bomb", mb=1500)
    assert report == {"written mb": str(MEMFD_MAX_MB), "error": "OSError 27"}


@pytest.mark.parametrize("model", ["hostile", "forking"])
def test_no_namespace_and_no_view_of_the_host(server: ServerProcess, model: str) -> None:
    """clone with CLONE_NEWUSER|CLONE_NEWNET fails as unshare does, even for a model that may
    start processes; its own /proc shows neither the sockets of its network namespace nor the
    mounts, and still its own status."""
    report = attack(server, model, attack="view")
    assert report["clone namespaces"] == "PermissionError"
    if landlock.abi():
        hidden = ("net/tcp", "/proc/net/tcp", "mountinfo", "thread mountinfo")
        assert {k: report[k] for k in hidden} == dict.fromkeys(hidden, "PermissionError")
    assert report["own status"].startswith("ok")


def test_child_processes_within_the_count_work(server: ServerProcess) -> None:
    assert attack(server, "forking", attack="popen") == {"popen": "ok: 'forked\\n'"}
    assert attack(server, "forking", attack="fork bomb", count=CHILDREN - 1) == {
        "forks": str(CHILDREN - 1),
        "error": "",
    }


def test_a_fork_bomb_past_the_count_fails_its_request(server: ServerProcess) -> None:
    """Killed by its launcher, every process with it; RESOURCE_EXHAUSTED names the limit, the
    request is not retried on the next worker, and the model serves again."""
    before = server.instances("forking")[0].pid
    with pytest.raises(grpc.RpcError) as failed:
        attack(server, "forking", attack="fork bomb", count=300)
    assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"more than python_child_processes ({CHILDREN})" in str(failed.value.details())
    assert not alive(before)
    died = "was killed for running more than python_child_processes (4) processes; 1 request(s)"
    assert server.log_text().count(f"{died} in it fail (RESOURCE_EXHAUSTED)") == 1
    kills = [
        s.value
        for s in server.metrics()
        if s.name == "paddlequic_worker_limit_kills_total" and s.labels["model"] == "forking"
    ]
    assert kills == [1.0]
    eventually(lambda: bool(attack(server, "forking", attack="popen")), "the restarted worker")


def test_forked_children_count_in_the_workers_memory(server: ServerProcess) -> None:
    """Three children of 700 MiB each, under python_memory_mb 1024: each within its own
    address-space limit, all three past the worker's cgroup, which the kernel then kills
    whole; the request fails RESOURCE_EXHAUSTED naming the limit."""
    (instance,) = server.instances("forking")
    if any(u.startswith("a cgroup of its own") for u in instance.unprotected):
        pytest.skip("no cgroup per worker on this host: memory is bounded per process only")
    with pytest.raises(grpc.RpcError) as failed:
        attack(server, "forking", attack="forked memory")
    assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeding its memory limit (python_memory_mb 1024 MiB)" in str(failed.value.details())
    eventually(lambda: bool(attack(server, "forking", attack="popen")), "the restarted worker")


def test_no_process_outlives_its_worker(server: ServerProcess) -> None:
    """A double-forked child in its own session, reparented away from the worker, dies with
    it."""
    orphan = int(attack(server, "forking", attack="orphan")["orphan"])
    assert alive(orphan)
    with pytest.raises(grpc.RpcError):
        attack(server, "forking", attack="exit")
    eventually(lambda: not alive(orphan), "the orphan's end")


def test_no_process_outlives_a_clean_stop(tmp_path: Path) -> None:
    for server in serve(tmp_path):
        orphan = int(attack(server, "forking", attack="orphan")["orphan"])
        assert alive(orphan)
        assert server.stop() == 0
    assert not alive(orphan)


def test_what_bounds_the_workers_is_said(server: ServerProcess) -> None:
    """At load (the log) and in ListInstances, per instance, for Python models: the cgroup's
    absence and its reason, or nothing when every worker has one."""
    log = server.log_text()
    for model in ("hostile", "forking"):
        (instance,) = server.instances(model)
        listed = [u for u in instance.unprotected if u.startswith("a cgroup of its own")]
        warned = [line for line in log.splitlines() if f"model {model}: {CGROUP_MISSING}" in line]
        assert len(listed) == len(warned) <= 1
        if listed:
            assert listed[0] in warned[0]
            assert "the launcher kills them all when the worker ends" in listed[0]
    if os.path.exists("/sys/fs/cgroup/unified") and not os.path.exists(
        "/sys/fs/cgroup/cgroup.controllers"
    ):  # a hybrid host: memory and pids are bound to cgroup v1
        assert CGROUP_MISSING in log


def test_a_model_refused_a_process_at_load_is_told_which_parameter_allows_it(
    server: ServerProcess,
) -> None:
    """Importing paddle starts processes: a model that does so without python_child_processes
    fails to load, and the reason names the parameter (not only EPERM)."""
    index = server.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=TIMEOUT_S).models
    (spawner,) = [m for m in index if m.name == "spawner"]
    assert spawner.state == "UNAVAILABLE"
    assert "python_child_processes" in spawner.reason, spawner.reason
