"""`python -m scripts.bench_rest_transports`: what a REST request costs over each transport.
Sequential `/infer` calls on `mlp` ([1, 256] FP32 as JSON) over HTTP/1.1 with TLS, HTTP/2 with
TLS and HTTP/3 (libcurl through curl_cffi, one connection per transport, kept), in rounds that
alternate the transports: the client-seen median latency and the server process's CPU per
request (user + system, /proc)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from curl_cffi import CurlHttpVersion, requests

from tests.servers import free_port, model_repository, running_server

TRANSPORTS = {
    "HTTP/1.1 + TLS": CurlHttpVersion.V1_1,
    "HTTP/2 + TLS": CurlHttpVersion.V2TLS,
    "HTTP/3": CurlHttpVersion.V3ONLY,
}
WARM_UP = 20  # calls per transport before the first round


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=300, help="calls per transport and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    body = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [1, 256],
                    "data": np.zeros((1, 256), np.float32).tolist(),
                }
            ]
        }
    )
    latency: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
    cpu: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        port = free_port()
        certs = root / "certs"
        flags = ["--http-port", str(port), "--http-tls", "--certs-dir", str(certs)]
        flags += ["--log-sample-ratio", "0"]
        repository = model_repository(root / "models", ["mlp"])
        with running_server(repository, root / "server.log", flags) as server:
            url = f"https://localhost:{port}/v2/models/mlp/infer"
            sessions: dict[str, Any] = {
                # curl_cffi takes a CA file where its annotation says bool
                name: requests.Session(http_version=version, verify=str(certs / "ca.pem"))  # type: ignore[arg-type]
                for name, version in TRANSPORTS.items()
            }

            def call(session: Any) -> None:
                answer = session.post(url, data=body, headers={"content-type": "application/json"})
                assert answer.status_code == 200, answer.content

            for session in sessions.values():
                for _ in range(WARM_UP):
                    call(session)
            for _ in range(args.rounds):
                for name, session in sessions.items():
                    times = []
                    before = cpu_seconds(server.process.pid)
                    for _ in range(args.calls):
                        started = time.perf_counter()
                        call(session)
                        times.append(time.perf_counter() - started)
                    used = cpu_seconds(server.process.pid) - before
                    latency[name].append(statistics.median(times) * 1e6)
                    cpu[name].append(used / args.calls * 1e6)
    print("| transport | median latency, us (per round) | server CPU per request, us (per round) |")
    print("| --- | --- | --- |")
    for name in TRANSPORTS:
        seen = ", ".join(f"{x:.0f}" for x in latency[name])
        spent = ", ".join(f"{x:.0f}" for x in cpu[name])
        print(f"| {name} | {seen} | {spent} |")


if __name__ == "__main__":
    main()
