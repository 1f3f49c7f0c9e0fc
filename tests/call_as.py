"""Calls of the inference service made by a process the test starts as another user, so the
server learns who calls from a socket that user made (`run_as` is the test's side; the child
is `python -m tests.call_as TRANSPORT TARGET`, its calls and the CA certificate as JSON on
stdin, each call's status code name and details as JSON on stdout)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from clients.quic_channel import QuicChannel
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
CALL_TIMEOUT_S = 30.0


def run_as(
    uid: int,
    transport: str,
    target: str,
    calls: Sequence[tuple[str, Any]],
    ca_file: Path,
    timeout_s: float = 120.0,
) -> list[tuple[str, str]]:
    """The status code name and details of each `(method, request)`, called in turn on one
    channel by a process of `uid`, with that uid as its only group and no capabilities
    (util-linux's setpriv)."""
    given = {
        "ca": ca_file.read_text(),
        "calls": [[method, request.SerializeToString().hex()] for method, request in calls],
    }
    done = subprocess.run(
        [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            sys.executable,
            "-m",
            "tests.call_as",
            transport,
            target,
        ],
        input=json.dumps(given),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [(code, details) for code, details in json.loads(done.stdout)]


async def _calls(transport: str, target: str, given: dict[str, Any]) -> list[list[str]]:
    if transport == "h2":
        channel: Any = grpc.aio.insecure_channel(target)
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".pem", delete=False) as ca_file:
            ca_file.write(given["ca"])
        channel = QuicChannel(target, ca_file=ca_file.name, server_name="localhost")
    answers = []
    try:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for method, request in given["calls"]:
            message = getattr(pb, f"{method}Request").FromString(bytes.fromhex(request))
            try:
                await getattr(stub, method)(message, timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                answers.append([error.code().name, error.details() or ""])
            else:
                answers.append(["OK", ""])
    finally:
        await channel.close()
    return answers


def main() -> None:
    transport, target = sys.argv[1:3]
    print(json.dumps(asyncio.run(_calls(transport, target, json.loads(sys.stdin.read())))))


if __name__ == "__main__":
    main()
