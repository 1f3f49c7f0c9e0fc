"""The KServe v2 REST API against the real server process, with real clients each in its own
process (curl over HTTP/1.1 and HTTP/2 by prior knowledge, tritonclient's HTTP client), its
answers compared with the gRPC answer for the same input, and every bound of an untrusted
network hit once."""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import h2.config
import h2.connection
import h2.events
import numpy as np
import pytest
from google.protobuf import text_format

from clients.inference_client import InferenceClient, build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.inference import model_config_pb2 as mc
from protos.paddlequic.v1.control_pb2 import ListInstancesRequest
from service.http.lingering import LINGER_BYTES, LINGER_S
from service.http.listener import MAX_STREAMS_PER_CONNECTION
from service.model.config_json import config_dict
from tests.servers import (
    HTTP_PORT,
    REPO_ROOT,
    ServerProcess,
    closed_by_peer,
    free_port,
    model_repository,
    paused,
    running_server,
)
from transport.tls.certs import issue_client_certificate

pytestmark = pytest.mark.e2e

RUNNING_SUM_FIXTURE = REPO_ROOT / "tests" / "fixtures" / "python_sequence"
MODELS = ("mlp", "two_tower", "text_classifier", "tokenizer", "label_postprocess", "generate")
MAX_INPUT = 4 << 20  # --http-max-input-size: a million-value tensor fits, 8 MiB does not
BODY_TIMEOUT_S = 3.0
MAX_REQUESTS = 8  # --max-concurrent-rpcs
MAX_CONNECTIONS = 32  # --http-max-connections
KEEPALIVE_TIMEOUT_S = 1.0
HELD_SETTLE_S = 0.5  # for requests sent to be let in before the server is asked anything else
PAST_LIMIT = 48 << 20  # a refused body's bytes past --http-max-input-size that a client sends
# What a connection's socket buffers may hold on loopback, both ends (tcp_rmem's and tcp_wmem's
# default maxima, 32 MiB and 4 MiB).
SOCKET_BUFFERS = 36 << 20
TRICKLE_S = 0.1  # between the bytes of a client trickling after its refusal
HTTP_VERSIONS = ("1.1", "2")
# A client process: its imports (tritonclient brings gevent) take long on a loaded machine.
CLIENT_TIMEOUT_S = 240
# mlp's input in a shared-memory region no one registered (its REST parameters).
SHM_PLACEMENT: dict[str, Any] = {"shared_memory_region": "nowhere", "shared_memory_byte_size": 1024}
SHM_INPUT: dict[str, Any] = {
    "name": "input",
    "datatype": "FP32",
    "shape": [1, 256],
    "parameters": SHM_PLACEMENT,
}


@dataclass(frozen=True)
class Rest:
    """The server: its REST port, and its gRPC stub for the answers to compare with."""

    port: int
    stub: pb_grpc.GRPCInferenceServiceStub
    process: ServerProcess


@pytest.fixture(scope="module")
def rest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rest]:
    root = tmp_path_factory.mktemp("http")
    repository = model_repository(root / "models", MODELS)
    args = (
        *("--http-port", HTTP_PORT),
        *("--http-max-input-size", str(MAX_INPUT)),
        *("--http-body-timeout", str(BODY_TIMEOUT_S)),
        *("--http-keepalive-timeout", str(KEEPALIVE_TIMEOUT_S)),
        *("--max-concurrent-rpcs", str(MAX_REQUESTS)),
        *("--http-max-connections", str(MAX_CONNECTIONS)),
    )
    shutil.copytree(RUNNING_SUM_FIXTURE, repository / "running_sum")
    with running_server(repository, root / "server.log", args) as server:
        yield Rest(server.http_port, server.stub, server)


def base(server: Rest) -> str:
    return f"http://127.0.0.1:{server.port}"


def curl(
    server: Rest, path: str, version: str, body: bytes | None = None
) -> tuple[int, str, bytes]:
    """curl in its own process: (status, HTTP version it spoke, body). `version`: 1.1, 2 (by
    prior knowledge) or h2c (HTTP/1.1 upgraded to HTTP/2)."""
    command = [
        "curl",
        "-s",
        {"1.1": "--http1.1", "2": "--http2-prior-knowledge", "h2c": "--http2"}[version],
        "-w",
        "\n%{http_code} %{http_version}",
        base(server) + path,
    ]
    if body is not None:
        command += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
    done = subprocess.run(command, input=body, capture_output=True, timeout=60, check=True)
    payload, _, trailer = done.stdout.rpartition(b"\n")
    status, spoken = trailer.decode().split()
    return int(status), spoken, payload


def json_input(name: str, array: np.ndarray[Any, Any], datatype: str) -> dict[str, Any]:
    data = [v.decode() for v in array.ravel()] if datatype == "BYTES" else array.tolist()
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": data}


def grpc_answer(
    server: Rest, model: str, inputs: dict[str, np.ndarray[Any, Any]]
) -> dict[str, np.ndarray[Any, Any]]:
    return parse_response(server.stub.ModelInfer(build_request(model, inputs), timeout=60))


def rest_arrays(document: dict[str, Any]) -> dict[str, np.ndarray[Any, Any]]:
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in document["outputs"]}


def test_readme_curl_examples(rest: Rest) -> None:
    """The REST section's commands, as README.md prints them, against this server's port."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## REST: KServe v2")[1].split("```sh\n")[1].split("```")[0]
    commands = section.replace("\n  ", " ").splitlines()
    assert len(commands) == 3
    outputs = []
    for command in commands:
        local = command.replace("localhost:8000", f"127.0.0.1:{rest.port}")
        done = subprocess.run(["bash", "-c", local], capture_output=True, timeout=60, text=True)
        assert done.returncode == 0, (command, done.stderr)
        outputs.append(done.stdout)
    assert json.loads(outputs[0]) == {"ready": True}
    answer = json.loads(outputs[1])
    (logits,) = answer["outputs"]
    tokens = np.array([[12, 7, 431, 9, 2]], np.int64)
    expected = grpc_answer(rest, "text_classifier", {"token_ids": tokens})["logits"]
    assert (logits["name"], logits["shape"]) == ("logits", [1, 4])
    np.testing.assert_allclose(np.array(logits["data"]).reshape(1, 4), expected, rtol=1e-5)
    assert json.loads(outputs[2])["name"] == "text_classifier"


@pytest.mark.parametrize("version", [*HTTP_VERSIONS, "h2c"])
def test_health_answers_triton_statuses_with_the_protocols_bodies(rest: Rest, version: str) -> None:
    """Triton's statuses (200, 400 for false: what tritonclient reads) with the Open
    Inference Protocol's bodies (what the KServe SDK's client reads)."""
    spoken = "2" if version == "h2c" else version
    for path, status, body in (
        ("/v2/health/live", 200, {"live": True}),
        ("/v2/health/ready", 200, {"ready": True}),
        ("/v2/models/mlp/ready", 200, {"name": "mlp", "ready": True}),
        ("/v2/models/nope/ready", 400, {"name": "nope", "ready": False}),
    ):
        answered, spoke, payload = curl(rest, path, version)
        assert (answered, spoke, json.loads(payload)) == (status, spoken, body)


@pytest.mark.parametrize("version", HTTP_VERSIONS)
def test_curl_infer_matches_grpc(rest: Rest, version: str) -> None:
    array = np.random.default_rng(1).standard_normal((3, 256), dtype=np.float32)
    request = {"id": "r1", "inputs": [json_input("input", array, "FP32")]}
    status, spoken, body = curl(rest, "/v2/models/mlp/infer", version, json.dumps(request).encode())
    assert (status, spoken) == (200, version), body
    document = json.loads(body)
    assert (document["model_name"], document["model_version"], document["id"]) == ("mlp", "1", "r1")
    expected = grpc_answer(rest, "mlp", {"input": array})
    answered = rest_arrays(document)
    assert answered.keys() == expected.keys()
    for name, values in expected.items():
        np.testing.assert_allclose(answered[name], values, rtol=1e-5, atol=1e-6)


def test_nested_and_flat_data_answer_the_same(rest: Rest) -> None:
    array = np.random.default_rng(2).standard_normal((2, 256), dtype=np.float32)
    nested = json_input("input", array, "FP32")
    flat = {**nested, "data": array.ravel().tolist()}
    answers = []
    for entry in (nested, flat):
        body = json.dumps({"inputs": [entry]}).encode()
        status, _, payload = curl(rest, "/v2/models/mlp/versions/1/infer", "1.1", body)
        assert status == 200, payload
        answers.append(rest_arrays(json.loads(payload)))
    for name in answers[0]:
        np.testing.assert_allclose(answers[0][name], answers[1][name])


def test_bytes_in_and_out_and_output_selection(rest: Rest) -> None:
    texts = np.array([[b"a good film"], [b"dull"]], dtype=object)
    body = json.dumps({"inputs": [json_input("text", texts, "BYTES")]}).encode()
    status, _, payload = curl(rest, "/v2/models/tokenizer/infer", "2", body)
    assert status == 200, payload
    np.testing.assert_array_equal(
        rest_arrays(json.loads(payload))["token_ids"],
        grpc_answer(rest, "tokenizer", {"text": texts})["token_ids"],
    )
    logits = np.array([[0.1, 2.0, 0.3, -1.0]], dtype=np.float32)
    body = json.dumps(
        {"inputs": [json_input("logits", logits, "FP32")], "outputs": [{"name": "label"}]}
    ).encode()
    status, _, payload = curl(rest, "/v2/models/label_postprocess/infer", "1.1", body)
    assert status == 200, payload
    outputs = json.loads(payload)["outputs"]
    expected = grpc_answer(rest, "label_postprocess", {"logits": logits})["label"]
    assert [(o["name"], o["datatype"], o["shape"]) for o in outputs] == [
        ("label", "BYTES", list(expected.shape))
    ]
    assert outputs[0]["data"] == [v.decode() for v in expected.ravel()]


def test_sequences_over_rest(rest: Rest) -> None:
    """Triton's sequence parameters: running_sum adds up a sequence's values in its worker, two
    sequences interleaved, one over HTTP/1.1, one over HTTP/2; a request without a sequence is
    refused by the sequence batcher, as on gRPC."""

    def add(sequence: int, value: int, **flags: bool) -> int:
        tensor = {"name": "value", "datatype": "INT64", "shape": [1, 1], "data": [[value]]}
        request = {"inputs": [tensor], "parameters": {"sequence_id": sequence, **flags}}
        version = "2" if sequence % 2 else "1.1"
        status, _, payload = curl(
            rest, "/v2/models/running_sum/infer", version, json.dumps(request).encode()
        )
        assert status == 200, payload
        (total,) = (o for o in json.loads(payload)["outputs"] if o["name"] == "total")
        return int(total["data"][0])

    assert add(41, 1, sequence_start=True) == 1
    assert add(42, 10, sequence_start=True) == 10
    assert add(41, 2) == 3
    assert add(42, 20) == 30
    assert add(41, 3, sequence_end=True) == 6
    assert add(42, 30, sequence_end=True) == 60
    status, _, payload = curl(
        rest,
        "/v2/models/running_sum/infer",
        "1.1",
        json.dumps(
            {"inputs": [{"name": "value", "datatype": "INT64", "shape": [1, 1], "data": [[1]]}]}
        ).encode(),
    )
    assert status == 400
    assert "sequence" in json.loads(payload)["error"]


def test_certified_sequences_are_refused_to_rest_callers(tmp_path: Path) -> None:
    """--sequence-callers certified: a REST caller has no certificate, so no sequence."""
    ca = issue_client_certificate(tmp_path / "certs", "x")[0].with_name("ca.pem")
    repository = tmp_path / "models"
    repository.mkdir()
    shutil.copytree(RUNNING_SUM_FIXTURE, repository / "running_sum")
    args = (
        *("--http-port", HTTP_PORT, "--certs-dir", str(tmp_path / "certs")),
        *("--tls-client-ca", str(ca), "--sequence-callers", "certified"),
    )
    with running_server(repository, tmp_path / "server.log", args) as server:
        tensor = {"name": "value", "datatype": "INT64", "shape": [1, 1], "data": [[1]]}
        request = {"inputs": [tensor], "parameters": {"sequence_id": 5, "sequence_start": True}}
        status, _, payload = curl(
            Rest(server.http_port, server.stub, server),
            "/v2/models/running_sum/infer",
            "1.1",
            json.dumps(request).encode(),
        )
    assert status == 400
    assert "for callers with a client certificate only" in json.loads(payload)["error"]


def test_repository_load_and_unload(tmp_path: Path) -> None:
    """--model-control-mode explicit: a model loads (with a config in place of its
    config.pbtxt), serves, and unloads over REST; without explicit mode both are refused."""
    repository = model_repository(tmp_path / "models", ["mlp"])
    args = ("--http-port", HTTP_PORT, "--model-control-mode", "explicit")
    with running_server(repository, tmp_path / "server.log", args) as server:
        rest = Rest(server.http_port, server.stub, server)
        assert curl(rest, "/v2/models/mlp/ready", "1.1")[0] == 400
        config = config_dict(
            text_format.Parse((repository / "mlp" / "config.pbtxt").read_text(), mc.ModelConfig())
        )
        config["max_batch_size"] = 8
        load = {"parameters": {"config": json.dumps(config)}}
        status, _, payload = curl(
            rest, "/v2/repository/models/mlp/load", "2", json.dumps(load).encode()
        )
        assert (status, payload) == (200, b"")
        assert curl(rest, "/v2/models/mlp/ready", "1.1")[0] == 200
        status, _, payload = curl(rest, "/v2/models/mlp/config", "1.1")
        assert json.loads(payload)["max_batch_size"] == 8
        bad = {"parameters": {"config": json.dumps(config), "file:1/model.json": "%%%"}}
        status, _, payload = curl(
            rest, "/v2/repository/models/mlp/load", "1.1", json.dumps(bad).encode()
        )
        assert status == 400
        assert "'file:1/model.json' must be base64" in json.loads(payload)["error"]
        assert curl(rest, "/v2/repository/models/mlp/unload", "1.1", b"")[:2] == (200, "1.1")
        assert curl(rest, "/v2/models/mlp/ready", "1.1")[0] == 400


def test_repository_control_needs_explicit_mode(rest: Rest) -> None:
    for action in ("load", "unload"):
        status, _, payload = curl(rest, f"/v2/repository/models/mlp/{action}", "1.1", b"")
        assert status == 400
        assert "--model-control-mode explicit" in json.loads(payload)["error"]


def test_classification_priority_and_timeout_as_on_grpc(rest: Rest) -> None:
    """An output asked with `classification` answers Triton's "score:index" texts, as gRPC's;
    `priority` and `timeout` are taken (and refused negative)."""
    array = np.random.default_rng(6).standard_normal((2, 256), dtype=np.float32)
    grpc_request = build_request("mlp", {"input": array})
    grpc_request.outputs.add(name="probabilities").parameters["classification"].int64_param = 3
    expected = parse_response(rest.stub.ModelInfer(grpc_request, timeout=60))["probabilities"]
    request = {
        "inputs": [json_input("input", array, "FP32")],
        "outputs": [{"name": "probabilities", "parameters": {"classification": 3}}],
        "parameters": {"priority": 1, "timeout": 60_000_000},
    }
    status, _, payload = curl(rest, "/v2/models/mlp/infer", "1.1", json.dumps(request).encode())
    assert status == 200, payload
    (output,) = json.loads(payload)["outputs"]
    assert (output["datatype"], output["shape"]) == ("BYTES", [2, 3])
    assert output["data"] == [v.decode() for v in expected.ravel()]
    for key in ("priority", "timeout"):
        bad = {**request, "parameters": {key: -1}}
        status, _, payload = curl(rest, "/v2/models/mlp/infer", "1.1", json.dumps(bad).encode())
        assert status == 400
        assert f"'{key}' must not be negative" in json.loads(payload)["error"]


def sse_events(payload: bytes) -> list[dict[str, Any]]:
    """The documents of a text/event-stream body, each `data: <json>` then a blank line."""
    events = payload.split(b"\n\n")
    assert events.pop() == b""
    assert all(e.startswith(b"data: ") for e in events), payload
    return [json.loads(e.removeprefix(b"data: ")) for e in events]


@pytest.mark.parametrize("version", HTTP_VERSIONS)
def test_generate_stream_matches_grpc_generation(rest: Rest, version: str) -> None:
    """Triton's generate_stream: an event per response, the text as gRPC's stream gives it."""
    request = {"text": "Once upon a time", "max_tokens": 12, "temperature": 0.8, "seed": 7}
    status, _, payload = curl(
        rest, "/v2/models/generate/generate_stream", version, json.dumps(request).encode()
    )
    assert status == 200, payload
    events = sse_events(payload)
    assert all((e["model_name"], e["model_version"]) == ("generate", "1") for e in events)
    text = "".join(e.get("text_delta", "") for e in events)
    with InferenceClient(f"grpc://127.0.0.1:{rest.process.port}") as client:
        chunks = list(client.generate("generate", "Once upon a time", 12, 0.8, 7))
    assert text == "".join(c.text for c in chunks)
    assert events[-1]["finish_reason"] == chunks[-1].finish_reason == "length"


def test_generate_answers_one_response(rest: Rest) -> None:
    """generate on a model that answers once (mlp: its input as a flat list, one batch row)
    is its infer answer; on a model that answers many times, refused for generate_stream; a
    refusal before the first event is the reply's status."""
    array = np.random.default_rng(8).standard_normal((1, 256), dtype=np.float32)
    body = json.dumps({"input": array.ravel().tolist()}).encode()
    status, _, payload = curl(rest, "/v2/models/mlp/generate", "1.1", body)
    assert status == 200, payload
    expected = grpc_answer(rest, "mlp", {"input": array})["probabilities"]
    np.testing.assert_allclose(json.loads(payload)["probabilities"], expected.ravel(), rtol=1e-5)
    request = json.dumps({"text": "Once", "max_tokens": 3}).encode()
    status, _, payload = curl(rest, "/v2/models/generate/generate", "1.1", request)
    assert status == 400
    assert "generate takes one: use generate_stream" in json.loads(payload)["error"]
    request = json.dumps({"text": "Once", "max_tokens": 0}).encode()
    status, _, payload = curl(rest, "/v2/models/generate/generate_stream", "2", request)
    assert status == 400
    assert "max_tokens must be at least 1" in json.loads(payload)["error"]
    request = json.dumps({"text": "Once", "nothing": 1}).encode()
    status, _, payload = curl(rest, "/v2/models/generate/generate_stream", "1.1", request)
    assert status == 400
    assert "has no input 'nothing'" in json.loads(payload)["error"]


def test_a_stream_whose_client_leaves_stops_generating(rest: Rest) -> None:
    """The client reads one event of a 250-token generation and closes its connection: the
    generation stops (its step count stops growing, far short of 250) and frees its place."""
    leaving_client_stops_its_generation(rest.process, rest.port)


def leaving_client_stops_its_generation(server: ServerProcess, port: int) -> None:
    """A generate_stream of 250 tokens whose client leaves after its first event."""

    def metric(name: str) -> float:
        return sum(
            s.value
            for s in server.metrics()
            if s.name == name and s.labels.get("model") == "generate"
        )

    steps = "paddlequic_inter_token_seconds_count"
    before = metric(steps)
    body = json.dumps({"text": "x", "max_tokens": 250}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
        connection.sendall(
            b"POST /v2/models/generate/generate_stream HTTP/1.1\r\nHost: x\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while b"data: " not in received:
            received += connection.recv(65536)
    deadline = time.monotonic() + 30
    while metric("paddlequic_active_generations") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stopped = metric(steps)
    time.sleep(0.5)
    assert metric(steps) == stopped
    assert stopped - before < 150


def test_a_graceful_stop_finishes_a_stream_in_flight(tmp_path: Path) -> None:
    """SIGTERM while a generate_stream answers: the stream goes on to its last event, a new
    connection is refused, and the server exits once nothing is in flight."""
    repository = model_repository(tmp_path / "models", ["generate"])
    args = ("--http-port", HTTP_PORT, "--grace-period", "120")
    body = json.dumps({"text": "x", "max_tokens": 64}).encode()
    with running_server(repository, tmp_path / "server.log", args) as server:
        port = server.http_port
        with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
            connection.sendall(
                b"POST /v2/models/generate/generate_stream HTTP/1.1\r\nHost: x\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            received = b""
            while b"data: " not in received:
                received += connection.recv(65536)
            server.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while True:  # the listener stops accepting once the stop began
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=5).close()
                except ConnectionRefusedError:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.05)
            while not received.endswith(b"0\r\n\r\n"):  # the chunked body's end
                data = connection.recv(65536)
                assert data, received[-200:]
                received += data
        assert server.process.wait(60) == 0
    events = [
        json.loads(line.removeprefix(b"data: "))
        for line in received.split(b"\r\n")
        if line.startswith(b"data: ")
    ]
    assert events[-1]["finish_reason"] == "length"  # all of its 64 tokens


def test_metadata_and_config_match_grpc(rest: Rest) -> None:
    status, _, payload = curl(rest, "/v2", "1.1")
    server = json.loads(payload)
    grpc_server = rest.stub.ServerMetadata(pb.ServerMetadataRequest())
    assert (status, server["name"], server["version"]) == (
        200,
        grpc_server.name,
        grpc_server.version,
    )
    assert set(server["extensions"]) <= set(grpc_server.extensions)
    status, _, payload = curl(rest, "/v2/models/two_tower/versions/1", "2")
    metadata = json.loads(payload)
    grpc_metadata = rest.stub.ModelMetadata(pb.ModelMetadataRequest(name="two_tower"))
    assert metadata == {
        "name": "two_tower",
        "versions": list(grpc_metadata.versions),
        "platform": grpc_metadata.platform,
        "inputs": [
            {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
            for t in grpc_metadata.inputs
        ],
        "outputs": [
            {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
            for t in grpc_metadata.outputs
        ],
    }
    status, _, payload = curl(rest, "/v2/models/mlp/config", "1.1")
    config = rest.stub.ModelConfig(pb.ModelConfigRequest(name="mlp")).config
    assert (status, json.loads(payload)) == (200, config_dict(config))
    assert json.loads(payload)["max_batch_size"] == 64  # a number, as Triton writes it


def test_rest_calls_are_counted_and_logged_as_grpc_calls_are(rest: Rest) -> None:
    """The same metrics, labelled transport="http" and by the gRPC method the route stands
    for; a failure in the request log with its error."""

    def count(**labels: str) -> float:
        wanted = {"transport": "http", **labels}
        return sum(
            s.value
            for s in rest.process.metrics()
            if s.name == "paddlequic_requests_total"
            and all(s.labels.get(k) == v for k, v in wanted.items())
        )

    ok = {"rpc": "ModelInfer", "model": "mlp", "version": "1", "code": "OK"}
    failed = {"rpc": "ModelMetadata", "code": "NOT_FOUND"}
    before = count(**ok), count(**failed)
    body = json.dumps(
        {"id": "logged-1", "inputs": [json_input("input", np.zeros((1, 256), np.float32), "FP32")]}
    )
    assert curl(rest, "/v2/models/mlp/infer", "2", body.encode())[0] == 200
    assert curl(rest, "/v2/models/absent-model", "1.1")[0] == 404
    assert (count(**ok), count(**failed)) == (before[0] + 1, before[1] + 1)
    lines = [line for line in rest.process.log_objects() if line.get("transport") == "http"]
    assert any(
        line["rpc"] == "ModelMetadata"
        and line["status"] == "NOT_FOUND"
        and "absent-model" in line["error"]
        for line in lines
    )


@pytest.mark.parametrize("leaving", ["closes its HTTP/1.1 connection", "resets its HTTP/2 stream"])
def test_a_client_that_leaves_takes_its_request_out_of_the_queue(rest: Rest, leaving: str) -> None:
    """With mlp's worker held still, gRPC calls fill its slots and one queues; a REST request
    queues behind them, its client leaves, and the request leaves the queue at once (before
    the worker moves again)."""
    (instance,) = rest.process.instances("mlp")
    request = build_request("mlp", {"input": np.zeros((1, 256), np.float32)})
    body = json.dumps({"inputs": [json_input("input", np.zeros((1, 256), np.float32), "FP32")]})

    def held(count: int) -> tuple[int, int]:
        """(queued, in a worker) once the server holds `count` requests of mlp, the same in
        5 looks in a row."""
        seen: list[tuple[int, int]] = []
        for _ in range(3000):
            listed = rest.process.control.ListInstances(
                ListInstancesRequest(model_name="mlp"), timeout=10
            )
            (queue,) = listed.queues
            now = (queue.queued, queue.in_flight)
            seen = [*seen, now] if seen and seen[-1] == now else [now]
            if sum(now) == count and len(seen) >= 5:
                return now
            time.sleep(0.01)
        raise AssertionError(f"the server never held {count} requests")

    calls = []
    with paused(instance.pid):
        queued = 0
        while queued == 0:  # one at a time: each fills a slot until none is left
            calls.append(rest.stub.ModelInfer.future(request, timeout=60))
            queued, _ = held(len(calls))
        with raw(rest) as connection:
            if leaving.startswith("closes"):
                connection.sendall(
                    b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
                )
                assert held(len(calls) + 1) == (queued + 1, len(calls) - queued)
            else:
                h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
                h2c.initiate_connection()
                path = "/v2/models/mlp/infer"
                headers = [(":method", "POST"), (":path", path), (":scheme", "http")]
                h2c.send_headers(1, [*headers, (":authority", "x")])
                h2c.send_data(1, body.encode(), end_stream=True)
                connection.sendall(h2c.data_to_send())
                assert held(len(calls) + 1) == (queued + 1, len(calls) - queued)
                h2c.reset_stream(1)
                connection.sendall(h2c.data_to_send())
                assert held(len(calls)) == (queued, len(calls) - queued)  # connection open
        assert held(len(calls)) == (queued, len(calls) - queued)
    for call in calls:
        call.result()


def test_repository_index_matches_grpc(rest: Rest) -> None:
    index = rest.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30).models
    expected = [
        {"name": m.name, "version": m.version, "state": m.state, "reason": m.reason} for m in index
    ]
    for body in (None, b'{"ready": true}', b""):
        status, _, payload = curl(rest, "/v2/repository/index", "2", body)
        if body is None:
            assert status == 405  # Triton's route is a POST
            continue
        assert (status, json.loads(payload)) == (200, expected)
    status, _, payload = curl(rest, "/v2/repository/index", "1.1", b'{"ready": 1}')
    assert status == 400
    assert "'ready' is true or false" in json.loads(payload)["error"]


def test_statistics_count_rest_calls(rest: Rest) -> None:
    def successes() -> int:
        status, _, payload = curl(rest, "/v2/models/mlp/stats", "1.1")
        assert status == 200
        (stats,) = json.loads(payload)["model_stats"]
        return int(stats["inference_stats"]["success"]["count"])

    before = successes()
    array = np.zeros((1, 256), np.float32)
    body = json.dumps({"inputs": [json_input("input", array, "FP32")]}).encode()
    assert curl(rest, "/v2/models/mlp/infer", "1.1", body)[0] == 200
    assert successes() == before + 1
    status, _, payload = curl(rest, "/v2/models/stats", "1.1")
    assert status == 200
    assert {s["name"] for s in json.loads(payload)["model_stats"]} == {*MODELS, "running_sum"}


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v2/models/nope", None, 404, "unknown model"),
        ("/v2/models/mlp/versions/7", None, 404, "version 7"),
        ("/v2/nothing/here", None, 404, "no route"),
        ("/v2/models/mlp/infer", None, 405, "takes POST"),
        (
            "/v2/models/generate/infer",
            {"inputs": []},
            501,
            "decoupled transaction policy",
        ),
        (
            "/v2/models/mlp/infer",
            {"inputs": [{"name": "input", "datatype": "FP64", "shape": [1, 256], "data": []}]},
            400,
            "expected datatype FP32",
        ),
        (
            "/v2/models/mlp/infer",
            {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 256], "data": ["x"]}]},
            400,
            "needs 256 values",
        ),
        ("/v2/models/mlp/infer", {"inputs": "none"}, 400, "'inputs' must be a JSON array"),
        (
            "/v2/models/mlp/infer",
            {"inputs": [{"name": ["a list"], "datatype": "FP32", "shape": [1], "data": [1]}]},
            400,
            "an input's 'name' must be a string",
        ),
        (
            "/v2/models/mlp/infer",
            {
                "inputs": [
                    {"name": "input", "datatype": "FP32", "shape": [1, 256], "data": [0] * 256}
                ]
                * 2
            },
            400,
            "input 'input' appears more than once",
        ),
        ("/v2/models/mlp/infer", {"id": "i" * 257, "inputs": []}, 400, "at most 256"),
        (
            "/v2/models/mlp/infer",
            {"inputs": [], "outputs": [{"name": "x", "parameters": {"shared_memory_region": "r"}}]},
            400,
            "output parameter shared_memory_region needs shared_memory_byte_size",
        ),
        (
            "/v2/models/mlp/infer",
            {
                "inputs": [
                    {
                        **SHM_INPUT,
                        "parameters": {**SHM_PLACEMENT, "shared_memory_byte_size": 4},
                    }
                ]
            },
            400,
            "input 'input' declares 1024 bytes, its shared_memory_byte_size is 4",
        ),
        (
            "/v2/models/mlp/infer",
            {"inputs": [SHM_INPUT]},
            404,
            "shared-memory region 'nowhere' is not registered",
        ),
        (
            "/v2/cudasharedmemory/region/gpu/register",
            {"raw_handle": {"b64": ""}, "device_id": 0, "byte_size": 8},
            400,
            "failed to register CUDA shared memory region: 'gpu', GPUs not supported",
        ),
        (
            "/v2/models/mlp/infer",
            {"inputs": [], "parameters": {"sequence_id": True}},
            400,
            "'sequence_id' must be an integer or a string",
        ),
    ],
)
def test_errors_are_triton_statuses_with_an_error_body(
    rest: Rest, path: str, body: Any, status: int, message: str
) -> None:
    sent = None if body is None else json.dumps(body).encode()
    got, _, payload = curl(rest, path, "1.1", sent)
    assert got == status, payload
    assert message in json.loads(payload)["error"]


def test_a_body_over_the_limit_is_refused_from_its_content_length(rest: Rest) -> None:
    """Only the headers are sent: the answer comes without the body being read."""
    with raw(rest) as connection:
        connection.sendall(
            b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n"
            + f"Content-Length: {MAX_INPUT + 1}\r\n\r\n".encode()
        )
        status, body = response(connection)
    assert status == 400
    assert f"more than --http-max-input-size {MAX_INPUT}" in json.loads(body)["error"]


def test_a_chunked_body_is_refused_once_it_passes_the_limit(rest: Rest) -> None:
    chunk = b"x" * (1 << 20)
    with raw(rest) as connection:
        connection.sendall(
            b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        try:
            for _ in range(MAX_INPUT // len(chunk) + 2):
                connection.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        except OSError:
            pass  # the server answered and closed while this was still sending
        status, body = response(connection)
    assert status == 400
    assert "more than --http-max-input-size" in json.loads(body)["error"]


def test_a_client_that_sends_its_whole_chunked_body_first_reads_the_400(rest: Rest) -> None:
    whole_chunked_body_refused(rest.port, MAX_INPUT)


def whole_chunked_body_refused(port: int, limit: int) -> None:
    """urllib (http.client) writes all of a body before it reads an answer. The server refuses
    this one once it passes `limit` and reads and drops the rest until the client is done (a
    lingering close) rather than closing with it unread, which resets the connection: the
    client's write would fail and it would never read its 400. PAST_LIMIT is more than the
    socket buffers can hold unread (SOCKET_BUFFERS), within LINGER_BYTES."""
    chunk = b" " * (1 << 20)
    body = itertools.repeat(chunk, (limit + PAST_LIMIT) // len(chunk))
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/mlp/infer",
        data=body,
        headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 400
    assert "more than --http-max-input-size" in json.loads(refused.value.read())["error"]


def refused_chunked_body(connection: socket.socket) -> None:
    """Sends a chunked body to `mlp` until it is past --http-max-input-size by a megabyte."""
    connection.sendall(
        b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b" " * (1 << 20)
    for _ in range(MAX_INPUT // len(chunk) + 1):
        connection.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")


def test_a_lingering_close_drops_at_most_its_bytes(rest: Rest) -> None:
    """A client that goes on sending after its refusal is cut off once the server has dropped
    LINGER_BYTES of it (plus what the socket buffers hold, at most SOCKET_BUFFERS)."""
    sent = 0
    with raw(rest) as connection:
        refused_chunked_body(connection)
        with pytest.raises(OSError):  # reset: the server closed with bytes unread
            while sent <= LINGER_BYTES + SOCKET_BUFFERS:
                connection.sendall(b" " * (1 << 16))
                sent += 1 << 16
        status, body = response(connection)
    assert LINGER_BYTES - MAX_INPUT <= sent <= LINGER_BYTES + SOCKET_BUFFERS
    assert status == 400
    assert "more than --http-max-input-size" in json.loads(body)["error"]


def test_a_lingering_close_ends_after_its_time(rest: Rest) -> None:
    """A client that read its refusal and the end of the stream, and goes on sending a byte at
    a time without closing, is dropped until LINGER_S has passed, then cut off (the loop's
    bound is ten times that)."""
    with raw(rest) as connection:
        refused_chunked_body(connection)
        status, _ = response(connection)
        assert status == 400
        while connection.recv(1 << 16):  # the answer's rest, if any, then the end
            pass
        sends = 0
        with pytest.raises(OSError):
            while sends < 10 * LINGER_S / TRICKLE_S:
                connection.sendall(b" ")
                sends += 1
                time.sleep(TRICKLE_S)
    assert sends > 2  # it lingered (a closed socket takes one write, then resets the next)


def test_requests_past_the_concurrency_limit_are_answered_429(rest: Rest) -> None:
    """MAX_REQUESTS requests held reading their bodies; one more is refused at once, and once
    they are gone requests are served again."""
    held = [raw(rest).socket for _ in range(MAX_REQUESTS)]
    try:
        for waiting in held:
            waiting.sendall(
                b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n{"
            )
        # Asked only once the held requests had time to be let in: a question in flight counts
        # as a request too, and with --frontends N a held request reaching another front-end
        # meanwhile was refused, leaving one fewer held than the limit for good.
        time.sleep(HELD_SETTLE_S)
        deadline = time.monotonic() + 30
        status = 200
        # Until the server has read the held requests' headers, asked on a kept-alive
        # connection: a new connection per question, in a loop, took a front-end's
        # --http-max-connections before it saw the earlier ones closed (the next was closed as
        # it was accepted). hypercorn closes a connection after 1000 requests: another then.
        probe: socket.socket | None = None
        try:
            while status == 200:
                assert time.monotonic() < deadline
                probe = probe or raw(rest).socket
                probe.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
                try:
                    status, body = response(probe)
                except ConnectionError:
                    probe.close()
                    probe = None
        finally:
            if probe is not None:
                probe.close()
        assert status == 429
        assert f"at most {MAX_REQUESTS} REST requests at once" in json.loads(body)["error"]
    finally:
        for waiting in held:
            waiting.close()
    deadline = time.monotonic() + 30
    while curl(rest, "/v2/health/live", "1.1")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_connections_past_the_bound_are_closed_as_they_are_accepted(rest: Rest) -> None:
    """Peers holding MAX_CONNECTIONS connections (each with half a request line): more are
    closed at once, the server's descriptors grow by the bound only, and once the held ones
    are gone requests are served again."""
    fds = f"/proc/{rest.process.process.pid}/fd"
    before = len(os.listdir(fds))
    with contextlib.ExitStack() as stack:
        peers = [stack.enter_context(raw(rest)) for _ in range(MAX_CONNECTIONS + 16)]
        for peer in peers:
            peer.sendall(b"GET /v2/hea")
        # Until the server has closed those past the bound (the idle timeout may close more):
        # unbounded, it held a descriptor for each of them meanwhile, until that timeout.
        most = 0
        deadline = time.monotonic() + 30
        while sum(closed_by_peer(peer, 0) for peer in peers) < 16:
            assert time.monotonic() < deadline
            most = max(most, len(os.listdir(fds)) - before)
            time.sleep(0.01)
        assert most <= MAX_CONNECTIONS + 4  # others come and go
    deadline = time.monotonic() + 30
    while curl(rest, "/v2/health/live", "1.1")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_body_that_stalls_is_answered_408(rest: Rest) -> None:
    with raw(rest) as connection:
        connection.sendall(
            b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
        )
        status, body = response(connection)
    assert status == 408
    assert "--http-body-timeout" in json.loads(body)["error"]


def test_a_connection_sending_no_complete_request_is_closed(rest: Rest) -> None:
    with raw(rest) as connection:
        connection.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # headers unfinished
        started = time.monotonic()
        assert connection.recv(1024) == b""  # closed by the server, with nothing sent
        assert time.monotonic() - started < 60


def test_an_idle_keep_alive_connection_is_closed(rest: Rest) -> None:
    with raw(rest) as connection:
        connection.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert response(connection)[0] == 200
        assert connection.recv(1024) == b""  # closed after --http-keepalive-timeout


def test_a_header_block_over_the_limit_is_refused(rest: Rest) -> None:
    with raw(rest) as connection:
        connection.sendall(
            b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (32 << 10) + b"\r\n\r\n"
        )
        status, body = response(connection)
    assert status == 431
    assert "more than 16384" in json.loads(body)["error"]


def test_http2_streams_per_connection_are_bounded(rest: Rest) -> None:
    """The server's SETTINGS bound a connection's concurrent streams; h2 refuses more."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    with raw(rest) as sock:
        sock.sendall(connection.data_to_send())
        events: list[Any] = []
        while not any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events):
            events += connection.receive_data(sock.recv(65536))
    assert connection.remote_settings.max_concurrent_streams == MAX_STREAMS_PER_CONNECTION
    assert connection.remote_settings.max_header_list_size == 16 << 10


def test_json_nesting_is_bounded_before_parsing(rest: Rest) -> None:
    body = b'{"inputs": ' + b"[" * 200 + b"]" * 200 + b"}"
    status, _, payload = curl(rest, "/v2/models/mlp/infer", "1.1", body)
    assert status == 400
    assert "nests 201 deep; at most 100" in json.loads(payload)["error"]


@pytest.mark.parametrize("nested", [False, True])
def test_values_past_the_shape_are_refused_before_conversion(rest: Rest, nested: bool) -> None:
    """A [1, 256] tensor sent with a million values."""
    values = [0] * 1_000_000
    data = [values] if nested else values
    tensor = {"name": "input", "datatype": "FP32", "shape": [1, 256], "data": data}
    body = json.dumps({"inputs": [tensor]}).encode()
    status, _, payload = curl(rest, "/v2/models/mlp/infer", "1.1", body)
    assert status == 400
    error = json.loads(payload)["error"]
    assert ("dimension 1 holds 1000000, not 256" if nested else "'data' holds 1000000") in error


def test_restricted_categories_need_their_header_on_rest_too(tmp_path: Path) -> None:
    """--restricted-protocol CATEGORIES:KEY=VALUE: a REST route of a restricted category is
    served to requests carrying `KEY: VALUE` (Triton's --http-restricted-api header), refused
    403 in Triton's words before its body is read otherwise; other categories stay open."""
    repository = model_repository(tmp_path / "models", ["mlp"])
    args = (
        *("--http-port", HTTP_PORT),
        *("--restricted-protocol", "model-repository,statistics:admin-key=s3cret"),
    )

    def status(path: str, body: bytes | None = None, **headers: str) -> tuple[int, bytes]:
        request = urllib.request.Request(server.http_url + path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as refused:
            return refused.code, refused.read()

    with running_server(repository, tmp_path / "server.log", args) as server:
        refusal = {"error": "This API is restricted, expecting header 'admin-key'"}
        for path, body in (("/v2/repository/index", b"{}"), ("/v2/models/mlp/stats", None)):
            code, payload = status(path, body)
            assert (code, json.loads(payload)) == (403, refusal)
            assert status(path, body, **{"admin-key": "wrong"})[0] == 403
            assert status(path, body, **{"admin-key": "s3cret"})[0] == 200
        assert status("/v2/health/ready")[0] == 200
        infer = {"inputs": [json_input("input", np.ones((1, 256), np.float32), "FP32")]}
        assert status("/v2/models/mlp/infer", json.dumps(infer).encode())[0] == 200
        # Refusals are counted under the method the route stands for, as gRPC's are.
        refused = [
            s
            for s in server.metrics()
            if s.name == "paddlequic_requests_total" and s.labels["code"] == "UNAUTHENTICATED"
        ]
        assert {(s.labels["transport"], s.labels["rpc"], s.value) for s in refused} == {
            ("http", "RepositoryIndex", 2),
            ("http", "ModelStatistics", 2),
        }


def test_rest_is_not_served_in_clear_text_beside_required_client_certificates(
    tmp_path: Path,
) -> None:
    """A plain REST port would be open to anyone: --require-client-cert needs --http-tls
    (tests/e2e/test_rest_mutual_tls.py serves it with TLS)."""
    ca = issue_client_certificate(tmp_path / "certs", "x")[0].with_name("ca.pem")
    args = ["--tls-client-ca", str(ca), "--require-client-cert", "--h2-tls"]
    error = "--require-client-cert needs --http-tls (or --http-port 0)"
    started = subprocess.run(
        [
            *(sys.executable, "-m", "service.server", "--model-repository", str(tmp_path)),
            *("--http-port", str(free_port()), *args),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 1
    assert error in started.stderr


def test_rest_over_tls_negotiates_http2_by_alpn(tmp_path: Path) -> None:
    repository = model_repository(tmp_path / "models", ["mlp"])
    certs = tmp_path / "certs"
    args = ("--http-port", HTTP_PORT, "--http-tls", "--certs-dir", str(certs), "--no-h3")
    with running_server(repository, tmp_path / "server.log", args) as server:
        port = server.http_port
        for flag, spoken in (("--http2", "2"), ("--http1.1", "1.1")):
            done = subprocess.run(
                [
                    *("curl", "-s", flag, "--cacert", str(certs / "ca.pem")),
                    *("-o", "/dev/null", "-w", "%{http_code} %{http_version}"),
                    f"https://localhost:{port}/v2/health/ready",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.stdout == f"200 {spoken}", done.stderr
        plain = subprocess.run(
            ["curl", "-s", f"http://localhost:{port}/v2/health/ready"],
            capture_output=True,
            timeout=60,
        )
        assert plain.returncode != 0  # no clear text on a TLS port


def tritonclient(rest: Rest, script: str, request: str) -> subprocess.CompletedProcess[str]:
    """One of the scripts below in a process of its own (tritonclient's HTTP client), given
    the server's REST address and `request` on stdin; it must succeed."""
    done = subprocess.run(
        [sys.executable, "-c", script, f"127.0.0.1:{rest.port}"],
        input=request,
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done


TRITONCLIENT = """
import json, sys
import numpy as np
import tritonclient.http as httpclient

url, request = sys.argv[1], json.loads(sys.stdin.read())
client = httpclient.InferenceServerClient(url)
assert client.is_server_live() and client.is_server_ready()
assert client.is_model_ready("mlp")
metadata = client.get_model_metadata("mlp")
config = client.get_model_config("mlp")
inputs = []
for name, (datatype, values) in request.items():
    array = np.array(values, dtype=np.float32)
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=False)
    inputs.append(tensor)
outputs = [httpclient.InferRequestedOutput("score", binary_data=False)]
result = client.infer("two_tower", inputs, outputs=outputs, request_id="t1")
try:
    client.infer("nope", inputs)
    failure = None
except Exception as exc:
    failure = str(exc)
response = result.get_response()
print(json.dumps({
    "metadata": metadata, "max_batch_size": config["max_batch_size"], "id": response["id"],
    "names": [o["name"] for o in response["outputs"]], "score": result.as_numpy("score").tolist(),
    "failure": failure,
}))
"""


def test_tritonclient_http_matches_grpc(rest: Rest) -> None:
    rest.process.wait_ready()  # a worker an earlier test held still may be restarting
    rng = np.random.default_rng(3)
    arrays = {
        "user": rng.standard_normal((2, 32), dtype=np.float32),
        "item": rng.standard_normal((2, 48), dtype=np.float32),
    }
    request = {name: ("FP32", array.tolist()) for name, array in arrays.items()}
    done = tritonclient(rest, TRITONCLIENT, json.dumps(request))
    answer = json.loads(done.stdout)
    assert answer["metadata"]["name"] == "mlp"
    assert answer["max_batch_size"] == 64
    assert (answer["id"], answer["names"]) == ("t1", ["score"])
    np.testing.assert_allclose(
        answer["score"], grpc_answer(rest, "two_tower", arrays)["score"], rtol=1e-5, atol=1e-6
    )
    assert "unknown model" in answer["failure"]


TRITONCLIENT_BINARY = """
import json, sys
import numpy as np
import tritonclient.http as httpclient

client = httpclient.InferenceServerClient(sys.argv[1])
request = json.loads(sys.stdin.read())


def inputs(model, arrays):
    made = []
    for name, (datatype, values) in arrays.items():
        array = np.array(values, dtype=object if datatype == "BYTES" else np.float32)
        if datatype == "BYTES":
            array = np.vectorize(str.encode, otypes=[object])(array)
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)  # binary data: tritonclient's default
        made.append(tensor)
    return made


answers = {}
for model, arrays in request.items():
    result = client.infer(model, inputs(model, arrays))  # no outputs named: all come as binary
    answers[model] = {
        o["name"]: [v.decode() if isinstance(v, bytes) else v
                    for v in result.as_numpy(o["name"]).ravel().tolist()]
        for o in result.get_response()["outputs"]
    }
    answers[model]["parameters"] = [o.get("parameters") for o in result.get_response()["outputs"]]
print(json.dumps(answers))
"""


def test_tritonclient_binary_data_matches_grpc(rest: Rest) -> None:
    """tritonclient's defaults: inputs as binary data, every output asked as binary data
    (`binary_data_output`), BYTES in and out as 4-byte length + bytes."""
    rng = np.random.default_rng(4)
    arrays: dict[str, dict[str, np.ndarray[Any, Any]]] = {
        "two_tower": {
            "user": rng.standard_normal((2, 32), dtype=np.float32),
            "item": rng.standard_normal((2, 48), dtype=np.float32),
        },
        "tokenizer": {"text": np.array([[b"a good film"], [b"\xc3\xa9t\xc3\xa9"]], dtype=object)},
        "label_postprocess": {"logits": np.array([[0.1, 2.0, 0.3, -1.0]], dtype=np.float32)},
    }
    request = {
        model: {
            name: (
                ("BYTES", [[v.decode() for v in row] for row in array.tolist()])
                if array.dtype == object
                else ("FP32", array.tolist())
            )
            for name, array in tensors.items()
        }
        for model, tensors in arrays.items()
    }
    done = tritonclient(rest, TRITONCLIENT_BINARY, json.dumps(request))
    answers = json.loads(done.stdout)
    for model, tensors in arrays.items():
        expected = grpc_answer(rest, model, tensors)
        got = answers[model]
        assert all("binary_data_size" in p for p in got.pop("parameters"))
        assert got.keys() == expected.keys()
        for name, values in expected.items():
            if values.dtype == object:
                assert got[name] == [v.decode() for v in values.ravel()]
            else:
                np.testing.assert_allclose(got[name], values.ravel(), rtol=1e-5, atol=1e-6)


TRITONCLIENT_COMPRESSED = """
import json, sys
import numpy as np
import tritonclient.http as httpclient

client = httpclient.InferenceServerClient(sys.argv[1])
array = np.array(json.loads(sys.stdin.read()), dtype=np.float32)
tensor = httpclient.InferInput("input", list(array.shape), "FP32")
tensor.set_data_from_numpy(array)
answers = {}
for sent, asked in (("gzip", "deflate"), ("deflate", "gzip")):
    result = client.infer(
        "mlp", [tensor], request_compression_algorithm=sent, response_compression_algorithm=asked
    )
    answers[sent] = result.as_numpy("probabilities").tolist()
print(json.dumps(answers))
"""


def test_tritonclient_compression_matches_grpc(rest: Rest) -> None:
    array = np.random.default_rng(5).standard_normal((2, 256), dtype=np.float32)
    done = tritonclient(rest, TRITONCLIENT_COMPRESSED, json.dumps(array.tolist()))
    expected = grpc_answer(rest, "mlp", {"input": array})["probabilities"]
    for answer in json.loads(done.stdout).values():
        np.testing.assert_allclose(answer, expected, rtol=1e-5, atol=1e-6)
    # The response is compressed as Accept-Encoding prefers (here deflate).
    body = json.dumps({"inputs": [json_input("input", array, "FP32")]}).encode()
    fetched = subprocess.run(
        [
            *("curl", "-s", "-H", "Accept-Encoding: gzip;q=0.1, deflate;q=0.5"),
            *("-w", "\n%header{content-encoding}", "--data-binary", "@-"),
            f"{base(rest)}/v2/models/mlp/infer",
        ],
        input=body,
        capture_output=True,
        timeout=60,
        check=True,
    )
    compressed, _, encoding = fetched.stdout.rpartition(b"\n")
    assert encoding == b"deflate"
    (output,) = json.loads(zlib.decompress(compressed))["outputs"]
    np.testing.assert_allclose(np.reshape(output["data"], (2, 10)), expected, rtol=1e-5)


def test_compressed_bodies_inflate_within_the_limit(rest: Rest) -> None:
    """A small gzip body inflating past --http-max-input-size is refused once its output
    passes the limit; an encoding not served is 501."""
    bomb = gzip.compress(b" " * (MAX_INPUT + 1))
    for encoding, body, status, message in (
        ("gzip", bomb, 400, "inflates past the limit"),
        ("br", b"{}", 501, "Content-Encoding 'br' is not served"),
        ("gzip", b"not gzip", 400, "invalid gzip message"),
    ):
        with raw(rest) as connection:
            connection.sendall(
                b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n"
                + f"Content-Length: {len(body)}\r\nContent-Encoding: {encoding}\r\n\r\n".encode()
                + body
            )
            got, payload = response(connection)
        assert got == status, payload
        assert message in json.loads(payload)["error"]


def test_binary_data_that_does_not_add_up_is_refused(rest: Rest) -> None:
    tensor = {
        "name": "input",
        "datatype": "FP32",
        "shape": [1, 256],
        "parameters": {"binary_data_size": 1024},
    }
    header = json.dumps({"inputs": [tensor]}).encode()
    for extra, message in (
        (b"", "runs past the binary data"),
        (b"\0" * 1028, "4 bytes of binary data follow"),
    ):
        body = header + extra
        with raw(rest) as connection:
            connection.sendall(
                b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n"
                + f"Content-Length: {len(body)}\r\n".encode()
                + f"Inference-Header-Content-Length: {len(header)}\r\n\r\n".encode()
                + body
            )
            status, payload = response(connection)
        assert status == 400
        assert message in json.loads(payload)["error"]


def raw_binary(server: Rest, model: str, body: bytes, version: str) -> tuple[int, bytes, str]:
    """curl in its own process sending `body` as a raw binary request, as Triton's binary
    data extension shows one: (status, body, its Inference-Header-Content-Length)."""
    done = subprocess.run(
        [
            *("curl", "-s", {"1.1": "--http1.1", "2": "--http2-prior-knowledge"}[version]),
            *("-H", "Content-Type: application/octet-stream"),
            *("-H", "Inference-Header-Content-Length: 0", "--data-binary", "@-"),
            *("-w", "\n%{http_code} %header{inference-header-content-length}"),
            f"{base(server)}/v2/models/{model}/infer",
        ],
        input=body,
        capture_output=True,
        timeout=60,
        check=True,
    )
    payload, _, trailer = done.stdout.rpartition(b"\n")
    status, _, length = trailer.decode().partition(" ")
    return int(status), payload, length


def binary_outputs(payload: bytes, length: str) -> dict[str, bytes]:
    """A binary data response's outputs: each one's bytes, in the order the JSON lists them."""
    document = json.loads(payload[: int(length)])
    outputs, offset = {}, int(length)
    for output in document["outputs"]:
        size = output["parameters"]["binary_data_size"]
        outputs[output["name"]] = payload[offset : offset + size]
        offset += size
    assert offset == len(payload)
    return outputs


@pytest.mark.parametrize("version", HTTP_VERSIONS)
def test_raw_binary_requests_match_grpc(rest: Rest, version: str) -> None:
    """A body that is one input's bytes (Inference-Header-Content-Length: 0): its shape comes
    from the model (a batch of one; a variable dimension from the body's length, BYTES one
    element), and every output comes back as binary data."""
    rng = np.random.default_rng(6)
    tensors: dict[str, tuple[str, np.ndarray[Any, Any], bytes]] = {
        "mlp": (
            "input",
            (array := rng.standard_normal((1, 256), dtype=np.float32)),
            array.tobytes(),
        ),
        "text_classifier": (
            "token_ids",
            (tokens := rng.integers(1, 100, (1, 7), dtype=np.int64)),
            tokens.tobytes(),
        ),
        "tokenizer": (
            "text",
            np.array([[b"caf\xc3\xa9 au lait"]], dtype=object),
            b"caf\xc3\xa9 au lait",
        ),
    }
    for model, (name, tensor, body) in tensors.items():
        status, payload, length = raw_binary(rest, model, body, version)
        assert status == 200, payload
        expected = grpc_answer(rest, model, {name: tensor})
        got = binary_outputs(payload, length)
        assert got.keys() == expected.keys()
        for output, values in expected.items():
            assert got[output] == values.tobytes(), (model, output)


def test_raw_binary_requests_the_model_cannot_take_are_refused(rest: Rest) -> None:
    for model, body, message in (
        ("two_tower", b"\0" * 128, "needs a model with one input; model 'two_tower' has 2"),
        ("mlp", b"\0" * 1020, "needs 1024 bytes of raw_input_contents, got 1020"),
        ("text_classifier", b"\0" * 12, "12 bytes are not a whole number of INT64 elements"),
    ):
        status, payload, _ = raw_binary(rest, model, body, "1.1")
        assert status == 400, payload
        assert message in json.loads(payload)["error"]


class _Listening(Protocol):
    @property
    def port(self) -> int: ...


class raw:
    """A plain TCP connection to the REST port, for requests no client would send."""

    def __init__(self, server: _Listening) -> None:
        self.socket = socket.create_connection(("127.0.0.1", server.port), timeout=60)

    def __enter__(self) -> socket.socket:
        return self.socket

    def __exit__(self, *exc_info: object) -> None:
        self.socket.close()


def response(connection: socket.socket) -> tuple[int, bytes]:
    """Status and body of an HTTP/1.1 response with a Content-Length."""
    received = b""
    while b"\r\n\r\n" not in received:
        data = connection.recv(65536)
        if not data:
            break
        received += data
    if not received:
        raise ConnectionError("the server closed the connection without an answer")
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = next(
        (
            int(v)
            for k, _, v in (line.partition(b":") for line in lines[1:])
            if k.lower() == b"content-length"
        ),
        0,
    )
    while len(body) < length:
        data = connection.recv(65536)
        if not data:
            break
        body += data
    return status, body
