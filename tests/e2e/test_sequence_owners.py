"""A sequence belongs to whoever started it. With client certificates (`--require-client-cert`),
a second caller naming a live sequence of the first, on another connection, on either
transport, through the front-end processes (`--frontends 2`) or the server's own listeners, is
refused: NOT_FOUND in the words of a sequence that never started for a request or an end,
ALREADY_EXISTS for a start, and the first caller's sequence goes on as if alone. With
`--sequence-callers certified`, a caller without a certificate cannot use sequences at all. A
sequence id the model's CORRID cannot hold exactly is refused, so two live sequences never
present the same CORRID to a model that keeps state by it."""

from __future__ import annotations

import re
import secrets
import shutil
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
from tests.e2e.test_sequences import FEATURES, FRAMES, RUNNING_SUM_FIXTURE
from tests.reference import kws_reference
from tests.servers import REPO_ROOT, ServerProcess, model_repository, running_server
from transport.tls.certs import issue_client_certificate

MODEL = "kws"
# running_sum (a sum per CORRID, in its worker) with a 32-bit and a string CORRID.
SUM_U32 = "running_sum_u32"
SUM_STRING = "running_sum_string"
CALL_TIMEOUT_S = 60.0


@dataclass
class Certified:
    server: ServerProcess
    ca: str
    alice: tuple[str, str]
    bob: tuple[str, str]

    def client(self, scheme: str, who: tuple[str, str] | None) -> InferenceClient:
        cert, key = who if who is not None else (None, None)
        url = f"{scheme}://localhost:{self.server.port}"
        return InferenceClient(url, self.ca, client_cert=cert, client_key=key)


def sum_model(repository: Path, name: str, corrid_type: str) -> None:
    """running_sum in one instance, its CORRID control of `corrid_type`."""
    target = repository / name
    shutil.copytree(RUNNING_SUM_FIXTURE, target)
    config = target / "config.pbtxt"
    text = config.read_text().replace('name: "running_sum"', f'name: "{name}"')
    text = text.replace("count: 2", "count: 1").replace("TYPE_UINT64", corrid_type)
    config.write_text(text)


def certified_server(root: Path, extra: list[str], sums: bool) -> Iterator[Certified]:
    certs = root / "certs"
    alice = issue_client_certificate(certs, "alice")
    bob = issue_client_certificate(certs, "bob")
    ca = str(certs / "ca.pem")
    repository = model_repository(root / "models", [MODEL])
    if sums:
        sum_model(repository, SUM_U32, "TYPE_UINT32")
        sum_model(repository, SUM_STRING, "TYPE_STRING")
    args = ["--certs-dir", str(certs), "--tls-client-ca", ca, *extra]
    with running_server(repository, root / "log", args, wait=False) as server:
        found = Certified(server, ca, (str(alice[0]), str(alice[1])), (str(bob[0]), str(bob[1])))
        deadline = time.monotonic() + 300
        while True:
            with suppress(grpc.RpcError), found.client("h3", found.alice) as client:
                if client.health() == "SERVING":
                    break
            assert server.process.poll() is None, server.log_text()
            assert time.monotonic() < deadline, server.log_text()
            time.sleep(0.3)
        yield found


@pytest.fixture(scope="module")
def required(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Certified]:
    """Client certificates required on both transports; calls through two front-ends."""
    root = tmp_path_factory.mktemp("sequence-owners")
    extra = ["--h2-tls", "--require-client-cert", "--frontends", "2"]
    yield from certified_server(root, extra, sums=True)


@pytest.fixture(scope="module")
def optional(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Certified]:
    """Client certificates optional (HTTP/3 only asks), sequences for certified callers only;
    calls on the server's own listeners."""
    root = tmp_path_factory.mktemp("sequence-certified")
    yield from certified_server(root, ["--sequence-callers", "certified"], sums=False)


def chunks(seed: int, length: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, FRAMES, FEATURES), dtype=np.float32) for _ in range(length)]


def refusal(client: InferenceClient, model: str, inputs: Any, **flags: Any) -> tuple[Any, str]:
    with pytest.raises(grpc.RpcError) as refused:
        client.infer(model, inputs, parameters=flags, timeout=CALL_TIMEOUT_S)
    return refused.value.code(), refused.value.details() or ""


def hijack(owner: InferenceClient, other: InferenceClient, seed: int) -> None:
    """`other` names `owner`'s live kws sequence between its requests: refused each time;
    `owner`'s scores are those of its sequence run alone."""
    frames = chunks(seed, 5)
    sequence = owner.sequence(MODEL)
    corrid = sequence.sequence_id
    scores = [sequence.infer({"features": c})["scores"] for c in frames[:2]]
    features = {"features": frames[0]}
    refused = [
        refusal(other, MODEL, features, sequence_id=corrid, **flags)
        for flags in ({}, {"sequence_end": True}, {"sequence_start": True})
    ]
    never = new_sequence_id()
    code, unknown = refusal(other, MODEL, features, sequence_id=never)
    assert code == grpc.StatusCode.NOT_FOUND
    as_unknown = (grpc.StatusCode.NOT_FOUND, unknown.replace(str(never), str(corrid)))
    assert refused[:2] == [as_unknown, as_unknown]
    assert refused[2][0] == grpc.StatusCode.ALREADY_EXISTS and "another id" in refused[2][1]
    scores += [
        sequence.infer({"features": c}, end=i == 2)["scores"] for i, c in enumerate(frames[2:])
    ]
    for served, alone in zip(scores, kws_reference(frames), strict=True):
        np.testing.assert_allclose(served, alone, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("scheme", ["grpcs", "h3"])
def test_another_certified_caller_cannot_touch_a_sequence(required: Certified, scheme: str) -> None:
    """Alice's sequence, Bob on another connection (and the other transport) with its id:
    NOT_FOUND for a request and an end, ALREADY_EXISTS for a start; Alice's scores are her
    sequence's alone. And the other way round."""
    other = "h3" if scheme == "grpcs" else "grpcs"
    with (
        required.client(scheme, required.alice) as alice,
        required.client(other, required.bob) as bob,
    ):
        hijack(alice, bob, seed=1)
        hijack(bob, alice, seed=2)


def test_the_same_caller_continues_its_sequence_on_any_connection(required: Certified) -> None:
    """The identity owns the sequence, not the connection: Alice's requests over HTTP/2 and
    HTTP/3 (landing on either front-end) are one sequence."""
    frames = chunks(3, 4)
    clients = [required.client(scheme, required.alice) for scheme in ("grpcs", "h3")]
    sequence_id = new_sequence_id()
    try:
        scores = []
        for i, chunk in enumerate(frames):
            parameters = {"sequence_id": sequence_id, "sequence_start": i == 0}
            parameters["sequence_end"] = i == len(frames) - 1
            answer = clients[i % 2].infer(
                MODEL, {"features": chunk}, parameters=parameters, timeout=CALL_TIMEOUT_S
            )
            scores.append(answer["scores"])
    finally:
        for client in clients:
            client.close()
    for served, alone in zip(scores, kws_reference(frames), strict=True):
        np.testing.assert_allclose(served, alone, rtol=1e-4, atol=1e-6)


def add(client: InferenceClient, model: str, value: int, **flags: Any) -> int:
    answer = client.infer(
        model, {"value": np.array([[value]], np.int64)}, parameters=flags, timeout=CALL_TIMEOUT_S
    )
    return int(answer["total"][0, 0])


def test_ids_a_corrid_cannot_hold_exactly_are_refused(required: Certified) -> None:
    """7 and 2**32 + 7 are one CORRID in a UINT32, "42" and 42 one in a STRING (as the model
    reads it): the second is refused saying why, and the first sequence's sum is intact
    (before, the second start reset it: a sum of 201 came out as 2)."""
    with required.client("h3", required.alice) as client:
        base = secrets.randbits(31) + 1
        assert add(client, SUM_U32, 1, sequence_id=base, sequence_start=True) == 1
        code, why = refusal(
            client,
            SUM_U32,
            {"value": np.array([[100]], np.int64)},
            sequence_id=base + 2**32,
            sequence_start=True,
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not fit" in why and "TYPE_UINT32" in why
        assert add(client, SUM_U32, 200, sequence_id=base, sequence_end=True) == 201

        name = str(base)
        assert add(client, SUM_STRING, 1, sequence_id=name, sequence_start=True) == 1
        code, why = refusal(
            client,
            SUM_STRING,
            {"value": np.array([[100]], np.int64)},
            sequence_id=base,
            sequence_start=True,
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "as a string" in why and "TYPE_STRING" in why
        assert add(client, SUM_STRING, 200, sequence_id=name, sequence_end=True) == 201


def test_certified_sequences_refuse_callers_without_a_certificate(optional: Certified) -> None:
    """`--sequence-callers certified`: a caller without a certificate (HTTP/3 without one,
    HTTP/2 in plain text) is UNAUTHENTICATED; one with a certificate is served, and its
    sequence is its own (in the server's own listeners, no front-end processes)."""
    chunk = chunks(4, 1)[0]
    server = optional.server
    for client in (optional.client("h3", None), InferenceClient(server.url)):
        with client:
            code, why = refusal(
                client, MODEL, {"features": chunk}, sequence_id=5, sequence_start=True
            )
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "--sequence-callers certified" in why
    with (
        optional.client("h3", optional.alice) as alice,
        optional.client("h3", optional.bob) as bob,
    ):
        hijack(alice, bob, seed=5)


def test_the_cli_sends_one_sequence_under_a_random_id(required: Certified) -> None:
    """`paddlequic infer --sequence`: its --repeat requests are one kws sequence (a second
    start or a request outside it would be refused), under a random 63-bit id."""
    alice_cert, alice_key = required.alice
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "clients.cli",
            "infer",
            MODEL,
            "--random",
            "--repeat",
            "3",
            "--sequence",
            *("--url", f"h3://localhost:{required.server.port}", "--ca-file", required.ca),
            *("--client-cert", alice_cert, "--client-key", alice_key),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    found = re.search(r"^sequence id: (\d+)$", run.stdout, re.M)
    assert found is not None and 0 < int(found.group(1)) < 2**63
    assert "scores: float32 [1, 12]" in run.stdout
