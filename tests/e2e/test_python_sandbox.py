"""The Python-model sandbox on a real server: a hostile model.py (tests/fixtures/python_attack)
tries each attack of the outside review from execute() while a Paddle model and another
Python model serve beside it, and every one fails; a protection this host lacks must instead
be named in the server's warning at load. `python_sandbox: "off"` is explicit: it is the only
way to lift the sandbox, it is logged, and any other value refuses the model."""

from __future__ import annotations

import json
import pwd
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from protos.paddlequic.v1 import control_pb2
from service.backend.sandbox import landlock, privileges, seccomp
from tests.e2e.test_python_model import infer
from tests.servers import ServerProcess, eventually, model_repository, running_server

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SECRET = "admin-Sandbox-5e1d"
TIMEOUT_S = 60.0
# Denied by Landlock (files, /proc of other processes, signals from ABI 6) and by seccomp
# (sockets, process_vm_readv) where the host has them.
BY_LANDLOCK = ("secret in /proc", "server environ", "server memory map", "tls key",
               "shared memory", "write file", "host memory", "other sysfs")  # fmt: skip
BY_SECCOMP = ("tcp connect", "udp socket", "unix socket", "read server memory")
CGROUP = "a cgroup of its own"


@dataclass
class Sandboxed:
    server: ServerProcess
    root: Path


# Its batch's answer on the socket its attack is written to (the server's batcher), so that the
# call fails with the kill: on its instance queues the answer comes through a ring, and
# whether it or the kill comes first is a race (the socket is read alike on both paths).
ON_THE_SOCKET = 'parameters { key: "python_instance_queues" value: { string_value: "false" } }\n'


def python_model(
    repository: Path, name: str, fixture: str, sandbox: str | None, extra: str = ""
) -> None:
    source = FIXTURES / fixture
    shutil.copytree(source, repository / name)
    config = (source / "config.pbtxt").read_text().replace('name: "attack"', f'name: "{name}"')
    if sandbox is not None:
        config += f'parameters {{ key: "python_sandbox" value: {{ string_value: "{sandbox}" }} }}\n'
    config += extra
    (repository / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def sandboxed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandboxed]:
    root = tmp_path_factory.mktemp("sandbox")
    repository = model_repository(root / "models", ["mlp"])
    python_model(repository, "attack", "python_attack", None)
    python_model(repository, "trusted", "python_attack", "off")
    python_model(repository, "typo", "python_attack", "no")
    python_model(repository, "pickler", "python_attack", None, ON_THE_SOCKET)
    python_model(repository, "queued_pickler", "python_attack", None)  # on its queues
    shutil.copytree(FIXTURES / "python_model", repository / "upper" / "1")
    shutil.move(repository / "upper" / "1" / "config.pbtxt", repository / "upper")
    args = ["--certs-dir", str(root / "certs")]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PADDLEQUIC_RESTRICTED_PROTOCOL", f"control:admin-key={SECRET}")
        with running_server(repository, root / "server.log", args, wait=False) as server:
            server.wait_loaded()
            yield Sandboxed(server, root)


def attack(sandboxed: Sandboxed, model: str, probe: dict[str, str] | None = None) -> dict[str, str]:
    probe = probe or {
        "port": str(sandboxed.server.port),
        "tls_key": str(sandboxed.root / "certs" / "server-key.pem"),
        "write": str(sandboxed.root / f"written-by-{model}"),
        "secret": SECRET,
    }
    text = np.array([json.dumps(probe).encode()], dtype=np.object_)
    request = build_request(model, {"probe": text})
    response = sandboxed.server.stub.ModelInfer(request, timeout=TIMEOUT_S)
    (report,) = parse_response(response)["report"].tolist()
    result: dict[str, str] = json.loads(report)
    return result


def instances(server: ServerProcess, model: str) -> list[control_pb2.Instance]:
    request = control_pb2.ListInstancesRequest(model_name=model)
    admin = [("triton-grpc-protocol-admin-key", SECRET)]
    return list(server.control.ListInstances(request, metadata=admin, timeout=5).instances)


def sandbox_protections(instance: control_pb2.Instance) -> list[str]:
    """What an instance lacks of the sandbox: not its cgroup, which every worker, Paddle's
    too, may lack (test_worker_processes.py)."""
    return [u for u in instance.unprotected if not u.startswith(CGROUP)]


def test_every_attack_of_a_python_model_fails(sandboxed: Sandboxed) -> None:
    server = sandboxed.server
    # Other callers' tensors in flight: the Paddle model's and the other Python model's
    # segments exist while the attack runs.
    mlp = build_request("mlp", {"input": np.ones((1, 256), np.float32)})
    server.stub.ModelInfer(mlp, timeout=TIMEOUT_S)
    assert infer(server, "neighbour")["upper"].tolist() == [[b"NEIGHBOUR"]]
    report = attack(sandboxed, "attack")
    assert SECRET not in json.dumps(report)
    version = landlock.abi()
    log = server.log_text()
    lacks = "model attack: this host lacks a Python sandbox protection"
    denied = [*(BY_LANDLOCK if version else ()), *(BY_SECCOMP if seccomp.supported() else ())]
    if version >= 6:
        denied.append("signal server")
    assert {name: report[name] for name in denied} == dict.fromkeys(denied, "PermissionError")
    assert not (sandboxed.root / "written-by-attack").exists()
    expected = []
    if not version:
        expected.append("Landlock (")
    elif version < 6:
        expected.append("Landlock ABI 6")
    if not seccomp.supported():
        expected.append("seccomp")
    if privileges.is_root() and report["uid"] == "0":
        expected.append("a user of its own (nobody cannot read")
    elif privileges.is_root():
        assert report["uid"] == str(pwd.getpwnam("nobody").pw_uid)
    warned = [line for line in log.splitlines() if lacks in line]
    assert len(warned) == len(expected)
    assert all(any(f"{lacks}: {e}" in line for line in warned) for e in expected), warned
    (listed,) = instances(server, "attack")
    sandbox = sandbox_protections(listed)
    assert len(sandbox) == len(expected)
    assert all(any(u.startswith(e) for u in sandbox) for e in expected)
    # The address-space limit holds, and no capability is left to lift it.
    assert report["memory limit mb"] == "1024"
    assert report["raise memory limit"] == "ValueError"
    assert report["allocate past limit"] == "MemoryError"
    if privileges.is_root():
        assert report["capabilities"] == "ok: '0000000000000000 0000000000000000'"
    # What Paddle, oneDNN and OpenBLAS read to detect the CPU stays readable; Paddle's way
    # (`cat /proc/cpuinfo`) needs python_child_processes, which this model does not have
    # (test_generate's paddle-importing example has it).
    cpu = ("cpu description", "cpu list")
    assert {name: report[name] for name in cpu} == dict.fromkeys(cpu, "ok: True")
    if seccomp.supported():
        assert report["cpuinfo by cat"] == "PermissionError"


def test_only_an_explicit_off_lifts_the_sandbox(sandboxed: Sandboxed) -> None:
    """What the sandbox denied works for a model marked trusted: the denials above are the
    sandbox's, not the host's."""
    server = sandboxed.server
    report = attack(sandboxed, "trusted")
    assert report["udp socket"].startswith("ok")
    assert report["tls key"].startswith("ok")
    assert (sandboxed.root / "written-by-trusted").read_text() == "escaped"
    assert "model trusted runs without the Python sandbox (python_sandbox: off)" in (
        server.log_text()
    )
    assert "model attack runs without the Python sandbox" not in server.log_text()
    (listed,) = instances(server, "trusted")
    assert sandbox_protections(listed) == ["python_sandbox: off"]
    index = server.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=5).models
    (typo,) = [m for m in index if m.name == "typo"]
    assert typo.state == "UNAVAILABLE"
    assert "parameter python_sandbox must be on or off, not 'no'" in typo.reason
    with pytest.raises(grpc.RpcError):
        attack(sandboxed, "typo")


def test_a_message_from_a_model_runs_no_code_in_the_front_end(sandboxed: Sandboxed) -> None:
    """The worker's socket is model.py's too: what it writes there is read with an allowlist
    of classes, and a worker that breaks the protocol is killed (its batch failed, not
    retried); the server serves on."""
    target = sandboxed.root / "made-by-the-front-end"
    with pytest.raises(grpc.RpcError) as refused:
        attack(sandboxed, "pickler", {"pickle": str(target)})
    assert refused.value.code() is grpc.StatusCode.INTERNAL
    assert not target.exists()
    assert "broke the protocol (UnpicklingError('worker message refers to posix.mkdir'))" in (
        sandboxed.server.log_text()
    )
    assert infer(sandboxed.server, "still")["upper"].tolist() == [[b"STILL"]]


def test_a_message_from_a_model_on_its_queues_runs_no_code_in_the_front_end(
    sandboxed: Sandboxed,
) -> None:
    """The same attack from a model whose requests go through its instance queues (its code
    names no BLS call): its socket is read as any worker's, the worker is killed for it, and
    no code runs; its answer comes through the queues, before or after the kill (a race, so
    only what the call cannot be is asserted)."""
    target = sandboxed.root / "made-by-the-front-end-too"
    server = sandboxed.server
    assert "model 'queued_pickler' version 1 takes its requests through its instances'" in (
        server.log_text()
    )
    (before,) = instances(server, "queued_pickler")
    try:
        attack(sandboxed, "queued_pickler", {"pickle": str(target)})
    except grpc.RpcError as failed:
        assert failed.code() is grpc.StatusCode.INTERNAL
    killed = f"(pid {before.pid}) broke the protocol (UnpicklingError('worker message refers to"
    eventually(lambda: killed in server.log_text(), "the worker killed for its message")
    assert not target.exists()
    eventually(
        lambda: any(
            i.pid != before.pid and i.state == "READY" for i in instances(server, "queued_pickler")
        ),
        "the worker restarted",
    )
    assert infer(server, "still")["upper"].tolist() == [[b"STILL"]]
