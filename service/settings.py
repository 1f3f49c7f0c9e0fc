"""Server configuration: one table of options, each a CLI flag with an environment variable
equivalent (PADDLEQUIC_<FLAG>); the flag wins over the variable, the variable over the default."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

ENV_PREFIX = "PADDLEQUIC_"


@dataclass(frozen=True)
class ServerSettings:
    model_repository: Path = Path("models")
    host: str = "0.0.0.0"
    grpc_port: int = 8001
    log_level: str = "info"
    grace_period: float = 5.0
    max_message_bytes: int = 64 << 20


_HELP = {
    "model_repository": "directory of models (NAME/config.pbtxt, NAME/VERSION/...)",
    "host": "address to listen on",
    "grpc_port": "TCP port for gRPC over HTTP/2 (0: any free port)",
    "log_level": "debug, info, warning or error",
    "grace_period": "seconds in-flight calls may take to finish on shutdown",
    "max_message_bytes": "largest request or response message accepted",
}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def build_parser(prog: str = "paddlequic serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve the models of a repository over gRPC (Open Inference Protocol).",
    )
    defaults = ServerSettings()
    for f in fields(ServerSettings):
        default = getattr(defaults, f.name)
        env = env_name(f.name)
        kind: Any = type(default)
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=kind(os.environ.get(env, default)),
            help=f"{_HELP[f.name]} (env {env}; default {default})",
        )
    return parser


def parse(argv: Sequence[str] | None = None) -> ServerSettings:
    return ServerSettings(**vars(build_parser().parse_args(argv)))
