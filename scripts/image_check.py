"""`make image-check`: run the CPU image as an operator would and check it from the host.

The example repository is mounted read-only (the image's uid 10001 must be able to read it), the
server listens on a port other than the image's default, chosen with PADDLEQUIC_GRPC_PORT (which
its HEALTHCHECK reads too), published over TCP (HTTP/2) and UDP (HTTP/3). The check waits for
Docker to call the container healthy, copies the development CA the container made out of it,
then calls health and inference over both transports. The container is removed on exit.
`--network host` instead of published ports, for engines without a working bridge.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from clients.inference_client import InferenceClient
from tests.servers import free_port

CONTAINER_PORT = 9001  # not the image's 8001: the HEALTHCHECK must follow the setting
CA_IN_CONTAINER = "/home/paddlequic/certs/ca.pem"
MODEL = "mlp"


def _docker(docker: str, *args: str) -> str:
    done = subprocess.run([docker, *args], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{docker} {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def _wait_healthy(docker: str, name: str, timeout_s: float) -> float:
    """Seconds until Docker reports the HEALTHCHECK healthy."""
    start = time.monotonic()
    while True:
        state = _docker(
            docker, "inspect", "--format", "{{.State.Status}} {{.State.Health.Status}}", name
        )
        if state == "running healthy":
            return time.monotonic() - start
        if not state.startswith("running"):
            raise RuntimeError(f"the container stopped ({state})")
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"not healthy after {timeout_s:.0f} s ({state})")
        time.sleep(1)


def _check(url: str, ca_file: str | None) -> str:
    with InferenceClient(url, ca_file) as client:
        status = client.health()
        if status != "SERVING":
            raise RuntimeError(f"{url}: health {status}")
        outputs = client.infer(MODEL, {"input": np.ones((1, 256), np.float32)}, timeout=30)
    (probabilities,) = outputs.values()
    if probabilities.shape[0] != 1 or not np.isclose(probabilities.sum(), 1.0, rtol=1e-4):
        raise RuntimeError(f"{url}: {MODEL} answered {probabilities!r}")
    return f"health SERVING, {MODEL} inference {probabilities.shape}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--image", default="paddlequic:cpu")
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--docker", default="docker")
    parser.add_argument("--network", choices=["bridge", "host"], default="bridge")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to become healthy")
    args = parser.parse_args(argv)

    docker = args.docker
    size = int(_docker(docker, "image", "inspect", "--format", "{{.Size}}", args.image))
    print(f"image {args.image}: {size / 1e9:.2f} GB")
    host_port = free_port()
    if args.network == "host":
        port, network = (
            host_port,
            ["--network", "host", "-e", f"PADDLEQUIC_METRICS_PORT={free_port()}"],
        )
    else:
        port, network = (
            CONTAINER_PORT,
            [
                "-p",
                f"127.0.0.1:{host_port}:{CONTAINER_PORT}/tcp",
                "-p",
                f"127.0.0.1:{host_port}:{CONTAINER_PORT}/udp",
            ],
        )
    name = f"paddlequic-image-check-{host_port}"
    command = [
        "run",
        "--detach",
        "--name",
        name,
        *network,
        "-e",
        f"PADDLEQUIC_GRPC_PORT={port}",
        "-v",
        f"{args.models.resolve()}:/models:ro",
        args.image,
    ]
    print(f"{docker} {' '.join(command)}")
    _docker(docker, *command)
    try:
        healthy_s = _wait_healthy(docker, name, args.timeout)
        print(f"healthy after {healthy_s:.0f} s (HEALTHCHECK on port {port}, interval 10 s)")
        with tempfile.TemporaryDirectory() as tmp:
            ca = str(Path(tmp) / "ca.pem")
            _docker(docker, "cp", f"{name}:{CA_IN_CONTAINER}", ca)
            for url, ca_file in (
                (f"grpc://127.0.0.1:{host_port}", None),
                (f"h3://localhost:{host_port}", ca),
            ):
                print(f"{url}: {_check(url, ca_file)}")
    except RuntimeError as exc:
        logs = subprocess.run(
            [docker, "logs", "--tail", "30", name], capture_output=True, text=True
        )
        print(logs.stdout + logs.stderr, file=sys.stderr)
        print(f"image-check FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        subprocess.run([docker, "rm", "--force", name], capture_output=True, timeout=60)
    print("image-check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
