"""The package as a new user gets it: a wheel built with build isolation from a clean clone of
the committed tree (so only the build step can provide the generated protobuf modules),
installed without extras into a fresh virtual environment, calling a real server with the
installed `paddlequic` over both transports.

Slow and needs PyPI (or pip's cache): deselect with `-m "not install"`."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from clients import __version__
from protos.inference import grpc_service_pb2 as pb
from tests.reference import output_names
from tests.servers import REPO_ROOT, ServerProcess, model_repository, running_server

pytestmark = pytest.mark.install

# What `pip install 'paddlequic[server]'` (and [cpu]/[gpu]) adds, and the code generator.
SERVER_ONLY_MODULES = (
    "paddle",
    "prometheus_client",
    "opentelemetry",
    "pynvml",
    "grpc_reflection",
    "grpc_tools",
    "redis",
)
PIP = (sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q")
STEP_TIMEOUT_S = 600


@dataclass(frozen=True)
class ClientInstall:
    wheel: Path
    bin: Path
    env: dict[str, str]
    cwd: Path

    def run(self, *command: str) -> subprocess.CompletedProcess[str]:
        """A program of the install, away from the repository, importing only what it holds."""
        executable = str(self.bin / command[0])
        return subprocess.run(
            [executable, *command[1:]],
            capture_output=True,
            text=True,
            cwd=self.cwd,
            env=self.env,
            timeout=120,
        )


def _step(command: list[str], env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=cwd, timeout=STEP_TIMEOUT_S
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def client_install(tmp_path_factory: pytest.TempPathFactory) -> ClientInstall:
    root = tmp_path_factory.mktemp("install")
    # Nothing of this checkout may leak in: the installed program imports what it installed.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    clone, dist, venv = root / "clone", root / "dist", root / "venv"
    _step(["git", "clone", "--quiet", str(REPO_ROOT), str(clone)], env, root)
    _step([*PIP, "wheel", "--no-deps", "--wheel-dir", str(dist), str(clone)], env, root)
    (wheel,) = dist.glob("paddlequic-*.whl")
    _step([sys.executable, "-m", "venv", "--without-pip", str(venv)], env, root)
    _step([*PIP, "--python", str(venv / "bin" / "python"), "install", str(wheel)], env, root)
    work = root / "work"
    work.mkdir()
    return ClientInstall(wheel, venv / "bin", env, work)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("install-server")
    repository = model_repository(root / "models", ["mlp"])
    with running_server(repository, root / "server.log", ["--certs-dir", str(certs_dir)]) as s:
        yield s


def test_the_wheel_holds_the_generated_modules(client_install: ClientInstall) -> None:
    names = set(zipfile.ZipFile(client_install.wheel).namelist())
    for proto in (REPO_ROOT / "protos").rglob("*.proto"):
        stem = proto.relative_to(REPO_ROOT).with_suffix("").as_posix()
        assert {f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"} <= names, stem


def test_a_client_install_has_no_server_dependencies(client_install: ClientInstall) -> None:
    """Every module of clients/, transport/ and protos/ imports; nothing the server needs is
    there."""
    check = (
        "import importlib, importlib.util, pkgutil\n"
        "for package in ('clients', 'transport', 'protos'):\n"
        "    for module in pkgutil.walk_packages(\n"
        "        importlib.import_module(package).__path__, package + '.'\n"
        "    ):\n"
        "        importlib.import_module(module.name)\n"
        f"for name in {SERVER_ONLY_MODULES!r}:\n"
        "    if importlib.util.find_spec(name) is not None:\n"
        "        print(name)\n"
    )
    done = client_install.run("python", "-c", check)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []


def test_server_commands_on_a_client_install_name_the_extra(
    client_install: ClientInstall,
) -> None:
    for command in ("serve", "topology"):
        done = client_install.run("paddlequic", command)
        assert done.returncode != 0
        assert done.stdout == ""
        assert len(done.stderr.splitlines()) == 1, done.stderr
        assert "pip install 'paddlequic[server]'" in done.stderr


def test_the_installed_cli_calls_the_server_over_both_transports(
    client_install: ClientInstall, server: ServerProcess, certs_dir: Path
) -> None:
    version = client_install.run("paddlequic", "--version")
    assert version.stdout.split() == ["paddlequic", __version__]
    metadata = server.stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=10)
    assert metadata.version == __version__

    ca_file = str(certs_dir / "ca.pem")
    outputs = []
    for transport, url in (
        ("h2", f"grpc://127.0.0.1:{server.port}"),
        ("h3", f"h3://localhost:{server.port}"),
    ):
        done = client_install.run(
            "paddlequic", "infer", "mlp", "--random", "--url", url, "--ca-file", ca_file
        )
        assert done.returncode == 0, done.stderr
        assert f"{output_names('mlp')[0]}: float32 [1, 10]" in done.stdout
        lines = done.stdout.splitlines()
        assert f"transport: {transport}" in lines  # the CLI says which one it used
        outputs.append([line for line in lines if not line.startswith("transport:")])
        perf = client_install.run(
            "paddlequic", "perf", "mlp", "--url", url, "--ca-file", ca_file,
            "--duration", "0.3", "--warmup", "0.1",
        )  # fmt: skip
        assert perf.returncode == 0, perf.stderr
        assert perf.stdout.split()[:3] == ["concurrency", "connect", "req/s"]
    assert outputs[0] == outputs[1]  # the same seeded inputs, the same answer on both
