"""`make bench-scale-kit`: wheels for running `make bench-scale` on a many-core host that has
no network and no Paddle, but a Python with numpy and the common scientific packages (`--have`).

The server's runtime distributions are taken from this checkout's environment, with their
dependencies, at the versions installed here (what the tests ran against), with paddlequic's
own wheel; those the host already has are left out. The wheels land in `--out` (default
`.whl/`), for `--python-version` on x86-64 Linux. On the host, `scripts/bench_scale_host.sh`
installs them into a folder of its own (nothing of the host's Python changes) and runs the
measurement with `mlp_numpy`, a Python-backend model, instead of the Paddle one.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import subprocess
import sys
from pathlib import Path
from typing import cast

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What the server imports when it runs a Python-backend model (the [server] extra).
ROOTS = (
    "grpcio",
    "protobuf",
    "grpcio-health-checking",
    "grpcio-reflection",
    "aioquic",
    "pylsqpack",
    "cryptography",
    "prometheus-client",
    "opentelemetry-api",
    "opentelemetry-sdk",
    "model-signing",
    "pyOpenSSL",
    "redis",
    "nvidia-ml-py",
)
# Left to the host unless it lacks them; grpcio and protobuf always travel: the generated code
# checks their versions.
HOST_HAS = (
    "numpy",
    "prometheus-client",
    "nvidia-ml-py",
    "attrs",
    "certifi",
    "charset-normalizer",
    "click",
    "idna",
    "markdown-it-py",
    "mdurl",
    "pygments",
    "requests",
    "rich",
    "typing-extensions",
    "urllib3",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def closure(roots: tuple[str, ...], python_version: str) -> dict[str, str]:
    """Each distribution `roots` need on Linux with `python_version`, and its version here."""
    environment: dict[str, str] = {
        **cast(dict[str, str], default_environment()),
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "extra": "",
    }
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(
                f"{name} is needed on Python {python_version} but not installed here, so its "
                "version is unknown: run this with the host's Python version (make setup "
                "PYTHON=python3.X), or add it to the wheels by hand"
            ) from None
        found[name] = distribution.version
        for line in distribution.requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(environment):
                todo.append(requirement.name)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(".whl"))
    parser.add_argument("--python-version", default="3.12", help="the host's Python (X.Y)")
    parser.add_argument(
        "--have",
        default=",".join(HOST_HAS),
        help="distributions the host's Python already has (comma-separated)",
    )
    args = parser.parse_args()
    have = {canonicalize_name(name) for name in args.have.split(",") if name}
    wanted = closure(ROOTS, args.python_version)
    pins = sorted(f"{name}=={version}" for name, version in wanted.items() if name not in have)
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"==> {len(pins)} wheels for Python {args.python_version} on x86-64, and paddlequic's "
        f"own, into {args.out}/"
    )
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--implementation",
        "cp",
        "--python-version",
        args.python_version,
        *platforms,
        "--dest",
        str(args.out),
        *pins,
    ]
    subprocess.run(command, check=True)
    # paddlequic itself: the server reads its own version from the installed metadata.
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "--wheel-dir", str(args.out), "."], check=True)
    size = sum(path.stat().st_size for path in args.out.glob("*.whl"))
    print(f"{args.out}/: {size / 2**20:.1f} MiB of wheels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
