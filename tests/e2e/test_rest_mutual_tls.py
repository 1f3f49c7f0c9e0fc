"""Mutual TLS on the REST port (`--http-tls` with `--tls-client-ca`): with
`--require-client-cert`, a client without a certificate from that CA is refused during the
handshake over HTTP/1.1, HTTP/2 (httpx) and HTTP/3 (libcurl through curl_cffi), each client in
a process of its own, in the server's own listeners and through front-end processes; a REST
caller is known by its certificate as a gRPC caller is, so a sequence is its starter's on
either protocol; with the certificate optional and `--sequence-callers certified`, a REST
caller without one is served but has no sequence."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from clients.inference_client import InferenceClient
from clients.sequences import new_sequence_id
from tests.servers import REPO_ROOT, ServerProcess, closed_by_peer, free_port, running_server
from transport.tls.certs import issue_client_certificate

pytestmark = pytest.mark.e2e

RUNNING_SUM_FIXTURE = REPO_ROOT / "tests" / "fixtures" / "python_sequence"
# A client process: its imports take long on a loaded machine.
CLIENT_TIMEOUT_S = 240
START_TIMEOUT_S = 300


@dataclass(frozen=True)
class Mutual:
    server: ServerProcess
    port: int  # REST, TCP and UDP
    ca: str
    alice: tuple[str, str]  # certificate and key from the server's CA
    bob: tuple[str, str]
    stranger: tuple[str, str]  # from another CA

    def grpc_client(self, who: tuple[str, str]) -> InferenceClient:
        url = f"grpcs://localhost:{self.server.port}"
        return InferenceClient(url, self.ca, client_cert=who[0], client_key=who[1])


def serve(root: Path, extra: list[str]) -> Iterator[Mutual]:
    certs = root / "certs"
    alice, bob = (issue_client_certificate(certs, name) for name in ("alice", "bob"))
    stranger = issue_client_certificate(root / "other-ca", "stranger")
    ca = str(certs / "ca.pem")
    repository = root / "models"
    repository.mkdir()
    shutil.copytree(RUNNING_SUM_FIXTURE, repository / "running_sum")
    port = free_port()
    args = [
        *("--certs-dir", str(certs), "--tls-client-ca", ca, "--h2-tls"),
        *("--http-port", str(port), "--http-tls", *extra),
    ]
    pair = [(str(c), str(k)) for c, k in (alice, bob, stranger)]
    with running_server(repository, root / "log", args, wait=False) as server:
        found = Mutual(server, port, ca, pair[0], pair[1], pair[2])
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with suppress(grpc.RpcError), found.grpc_client(found.alice) as client:
                if client.health() == "SERVING":
                    break
            assert server.process.poll() is None, server.log_text()
            assert time.monotonic() < deadline, server.log_text()
            time.sleep(0.3)
        yield found


@pytest.fixture(scope="module", params=["own listeners", "--frontends 2"])
def required(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    extra = ["--require-client-cert"]
    if request.param != "own listeners":
        extra += request.param.split()
    yield from serve(tmp_path_factory.mktemp("rest-mtls"), extra)


@pytest.fixture(scope="module")
def optional(tmp_path_factory: pytest.TempPathFactory) -> Any:
    yield from serve(
        tmp_path_factory.mktemp("rest-mtls-optional"),
        ["--sequence-callers", "certified", "--h2-handshake-timeout", "5"],
    )


# The clients, each in a process of its own, given [url, HTTP version, certificate and key or
# null, JSON body or null] per call on stdin; each answer is [status, HTTP version, body] or
# ["refused", the error's type].
HTTPX = """
import json, ssl, sys
import httpx

ca = sys.argv[1]
answers = []
for url, version, who, body in json.loads(sys.stdin.read()):
    context = ssl.create_default_context(cafile=ca)
    if who is not None:
        context.load_cert_chain(*who)
    try:
        with httpx.Client(verify=context, http1=version == "1.1", http2=version == "2") as client:
            r = client.post(url, json=body) if body is not None else client.get(url)
            answers.append([r.status_code, r.http_version, r.text])
    except (httpx.TransportError, ssl.SSLError) as exc:
        answers.append(["refused", type(exc).__name__])
print(json.dumps(answers))
"""
CURL_H3 = """
import json, sys
from curl_cffi import CurlHttpVersion, requests
from curl_cffi.requests.exceptions import RequestException

ca = sys.argv[1]
answers = []
for url, version, who, body in json.loads(sys.stdin.read()):
    options = {"http_version": CurlHttpVersion.V3ONLY, "verify": ca, "timeout": 60}
    if who is not None:
        options["cert"] = tuple(who)
    try:
        if body is None:
            r = requests.get(url, **options)
        else:
            r = requests.post(url, json=body, **options)
        answers.append([r.status_code, str(r.http_version), r.text])
    except RequestException as exc:
        answers.append(["refused", type(exc).__name__])
print(json.dumps(answers))
"""
Call = tuple[str, str, tuple[str, str] | None, Any]


def calls(mutual: Mutual, made: list[Call]) -> list[list[Any]]:
    """Each call by its client: httpx over HTTP/1.1 and HTTP/2, curl_cffi over HTTP/3 (in
    order, one process per run of one client's calls)."""
    answers: list[list[Any]] = []
    start = 0
    while start < len(made):
        h3 = made[start][1] == "3"
        end = start
        while end < len(made) and (made[end][1] == "3") == h3:
            end += 1
        done = subprocess.run(
            [sys.executable, "-c", CURL_H3 if h3 else HTTPX, mutual.ca],
            input=json.dumps(made[start:end]),
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
            cwd=REPO_ROOT,
        )
        assert done.returncode == 0, done.stderr
        answers += json.loads(done.stdout)
        start = end
    return answers


def url(mutual: Mutual, path: str) -> str:
    return f"https://localhost:{mutual.port}{path}"


def add(sequence: int, value: int, **flags: bool) -> dict[str, Any]:
    """running_sum's request adding `value` to sequence `sequence`."""
    tensor = {"name": "value", "datatype": "INT64", "shape": [1, 1], "data": [[value]]}
    return {"inputs": [tensor], "parameters": {"sequence_id": sequence, **flags}}


def total(answer: list[Any]) -> int:
    assert answer[0] == 200, answer
    (output,) = (o for o in json.loads(answer[2])["outputs"] if o["name"] == "total")
    return int(output["data"][0])


def test_only_clients_with_a_certificate_from_the_ca_are_served(required: Mutual) -> None:
    """Over HTTP/1.1, HTTP/2 and HTTP/3: Alice's certificate is served; none, or one from
    another CA, is refused before any request is read."""
    ready = url(required, "/v2/health/ready")
    made: list[Call] = []
    for version in ("1.1", "2", "3"):
        made += [(ready, version, who, None) for who in (required.alice, None, required.stranger)]
    answers = calls(required, made)
    spoken = {"1.1": "HTTP/1.1", "2": "HTTP/2", "3": "30"}  # curl_cffi names HTTP/3 30
    for index, version in enumerate(("1.1", "2", "3")):
        served, without, stranger = answers[3 * index : 3 * index + 3]
        assert served[:2] == [200, spoken[version]], served
        assert without[0] == stranger[0] == "refused", (without, stranger)


def test_a_sequence_is_its_certificates_on_either_protocol(required: Mutual) -> None:
    """Alice starts a sequence over REST; Bob naming it over REST is refused in the very words
    a sequence that never started gets (404); Alice goes on over gRPC and ends it over
    HTTP/3: one sum."""
    sequence, never = new_sequence_id(), new_sequence_id()
    alice, bob = required.alice, required.bob
    infer = url(required, "/v2/models/running_sum/infer")
    started, hijacked, unknown = calls(
        required,
        [
            (infer, "2", alice, add(sequence, 1, sequence_start=True)),
            (infer, "1.1", bob, add(sequence, 100)),
            (infer, "1.1", bob, add(never, 100)),
        ],
    )
    assert total(started) == 1
    assert hijacked[0] == unknown[0] == 404, (hijacked, unknown)
    assert hijacked[2] == unknown[2].replace(str(never), str(sequence))
    with required.grpc_client(alice) as client:
        answer = client.infer(
            "running_sum",
            {"value": np.array([[2]], np.int64)},
            parameters={"sequence_id": sequence},
            timeout=60,
        )
    assert int(answer["total"][0, 0]) == 3
    (ended,) = calls(required, [(infer, "3", alice, add(sequence, 3, sequence_end=True))])
    assert total(ended) == 6


def test_certified_sequences_serve_rest_callers_with_a_certificate(optional: Mutual) -> None:
    """--tls-client-ca without --require-client-cert: a client without a certificate is served,
    but under --sequence-callers certified has no sequence (400, naming the rule); one from
    another CA is refused; Alice's sequence is served, and hers."""
    ready = url(optional, "/v2/health/ready")
    infer = url(optional, "/v2/models/running_sum/infer")
    sequence = new_sequence_id()
    answers = calls(
        optional,
        [
            (ready, "2", None, None),
            (ready, "2", optional.stranger, None),
            (infer, "1.1", None, add(sequence, 1, sequence_start=True)),
            (infer, "2", optional.alice, add(sequence, 1, sequence_start=True)),
            (infer, "2", optional.bob, add(sequence, 100)),
            (infer, "1.1", optional.alice, add(sequence, 2, sequence_end=True)),
        ],
    )
    anyone, stranger, uncertified, started, hijacked, ended = answers
    assert anyone[0] == 200 and stranger[0] == "refused", (anyone, stranger)
    assert uncertified[0] == 400, uncertified
    assert "--sequence-callers certified" in json.loads(uncertified[2])["error"]
    assert (total(started), hijacked[0], total(ended)) == (1, 404, 3)


def test_a_peer_that_never_starts_its_tls_handshake_is_closed_at_the_idle_timeout(
    optional: Mutual,
) -> None:
    """A TLS handshake is a connection with no request in progress: --http-keepalive-timeout
    (5 s) ends it, not hypercorn's 60 s."""
    with socket.create_connection(("127.0.0.1", optional.port)) as connection:
        assert closed_by_peer(connection, 30)  # a bound on the wait: closed by 5 s


def test_a_peer_that_never_starts_its_grpc_tls_handshake_is_dropped(optional: Mutual) -> None:
    """--h2-tls: --h2-handshake-timeout (5 s here) drops a peer that never sends its
    ClientHello; grpc core's own bound held it 120 s."""
    with socket.create_connection(("127.0.0.1", optional.server.port)) as connection:
        assert closed_by_peer(connection, 60)  # a bound on the wait: dropped by 5 s
