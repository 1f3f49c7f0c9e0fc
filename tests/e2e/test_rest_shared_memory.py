"""Triton's system shared-memory extension over REST under the rules it has over gRPC
(tests/e2e/test_shared_memory.py): one set of regions for both protocols, a REST caller known
by the uid that owns its connection (callers started as uid 65534), an object used only as far
as that uid could open it, `--shared-memory off`, and the `shared-memory` restricted-protocol
category on the routes and on every infer request that names a region."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from protos.inference import grpc_service_pb2 as pb
from tests.e2e.test_shared_memory import NOBODY, ROOT_ONLY, Segment
from tests.reference import example_inputs
from tests.servers import HTTP_PORT, REPO_ROOT, ServerProcess, model_repository, running_server

CALL_TIMEOUT_S = 60
STRINGS = REPO_ROOT / "tests" / "fixtures" / "simple_string"
MAX_INPUT = 64 << 10  # --http-max-input-size: also the most one input takes from a region
# `python -c REST_CALLS HOST:PORT`, the calls as JSON on stdin ([method, path, body, headers]),
# each answer's status and body as JSON on stdout.
REST_CALLS = """
import http.client, json, sys
conn = http.client.HTTPConnection(sys.argv[1], timeout=60)
answers = []
for method, path, body, headers in json.loads(sys.stdin.read()):
    data = None if body is None else json.dumps(body)
    conn.request(method, path, body=data, headers=headers)
    response = conn.getresponse()
    answers.append([response.status, response.read().decode()])
print(json.dumps(answers))
"""
Call = tuple[str, str, Any, dict[str, str]]


class Rest:
    def __init__(self, server: ServerProcess, port: int) -> None:
        self.server = server
        self.address = f"127.0.0.1:{port}"

    def calls(self, calls: list[Call], uid: int | None = None) -> list[tuple[int, str]]:
        """Each call's status and body, made in turn on one connection by a process of `uid`
        (None: the test's own) with no other group and no capabilities."""
        become = [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}"]
        become += ["--clear-groups"] if uid is not None else []
        done = subprocess.run(
            [*become, sys.executable, "-c", REST_CALLS, self.address],
            input=json.dumps(calls),
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
            timeout=CALL_TIMEOUT_S,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return [(status, body) for status, body in json.loads(done.stdout)]


def start(root: Path, name: str, args: list[str]) -> Any:
    repository = model_repository(root / name, ["mlp"])
    (repository / "simple_string" / "1").mkdir(parents=True)
    shutil.copy(STRINGS / "config.pbtxt", repository / "simple_string" / "config.pbtxt")
    shutil.copy(STRINGS / "model.py", repository / "simple_string" / "1" / "model.py")
    args = ["--no-h3", "--http-port", HTTP_PORT, *args]
    return running_server(repository, root / f"{name}.log", args)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Rest]]:
    """One server as started by default (--shared-memory local; a small request body), one
    with shared memory off, one whose shared-memory category is restricted, and one whose
    REST calls come through front-end processes (the parent looks their callers up)."""
    root = tmp_path_factory.mktemp("rest-shm")
    plain = start(root, "plain", ["--http-max-input-size", str(MAX_INPUT)])
    off = start(root, "off", ["--shared-memory", "off"])
    restricted_args = ["--restricted-protocol", "shared-memory:admin-key=let-me-in"]
    restricted = start(root, "restricted", restricted_args)
    frontends = start(root, "frontends", ["--frontends", "2"])
    with plain as p, off as o, restricted as r, frontends as f:
        yield {
            "plain": Rest(p, p.http_port),
            "off": Rest(o, o.http_port),
            "restricted": Rest(r, r.http_port),
            "frontends": Rest(f, f.http_port),
        }


@pytest.fixture
def segments() -> Iterator[list[Segment]]:
    made: list[Segment] = []
    yield made
    for segment in made:
        segment.path.unlink(missing_ok=True)


def infer_body(region: str, array: np.ndarray[Any, Any]) -> dict[str, Any]:
    """mlp's input read from `region`, its output answered in the message."""
    placement = {"shared_memory_region": region, "shared_memory_byte_size": array.nbytes}
    tensor = {"name": "input", "datatype": "FP32", "shape": list(array.shape)}
    return {"inputs": [{**tensor, "parameters": placement}]}


def register(name: str, segment: Segment, size: int = 4096) -> Call:
    path = f"/v2/systemsharedmemory/region/{name}/register"
    return ("POST", path, {"key": segment.key, "offset": 0, "byte_size": size}, {})


def test_regions_are_one_set_for_both_protocols(
    servers: dict[str, Rest], segments: list[Segment]
) -> None:
    """Registered over REST, listed over gRPC; an input read from it over REST answers what
    the same input in the message answers."""
    rest = servers["plain"]
    array = example_inputs("mlp", seed=21)["input"]
    segment = Segment(4096)
    segments.append(segment)
    segment.write(array.tobytes())
    status, _ = rest.calls([register("both", segment)])[0]
    assert status == 200
    try:
        listed = rest.server.stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
        assert listed.regions["both"].key == segment.key
        inline = {"name": "input", "datatype": "FP32", "shape": list(array.shape)}
        inline["data"] = array.flatten().tolist()
        (placed, sent) = rest.calls(
            [
                ("POST", "/v2/models/mlp/infer", infer_body("both", array), {}),
                ("POST", "/v2/models/mlp/infer", {"inputs": [inline]}, {}),
            ]
        )
        assert placed[0] == sent[0] == 200
        outputs = [json.loads(body)["outputs"][0]["data"] for _, body in (placed, sent)]
        np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-6)
    finally:
        rest.calls([("POST", "/v2/systemsharedmemory/region/both/unregister", None, {})])
    assert rest.calls([("GET", "/v2/systemsharedmemory/status", None, {})]) == [(200, "[]")]


@pytest.mark.parametrize("name", ["plain", "frontends"])
def test_a_rest_caller_is_the_uid_that_owns_its_connection(
    servers: dict[str, Rest], segments: list[Segment], name: str
) -> None:
    """uid 65534 over REST: root's region (registered over gRPC) is unknown to it, root's 0600
    object cannot be registered, root's 0644 one can, but takes no output."""
    rest = servers[name]
    array = example_inputs("mlp", seed=22)["input"]
    mine, secret, readable = Segment(4096, 0o666), Segment(4096, ROOT_ONLY), Segment(4096, 0o644)
    segments += [mine, secret, readable]
    mine.write(array.tobytes())
    readable.write(array.tobytes())
    rest.server.stub.SystemSharedMemoryRegister(
        pb.SystemSharedMemoryRegisterRequest(name="mine", key=mine.key, byte_size=4096)
    )
    written_back = infer_body("shared", array)
    written_back["outputs"] = [
        {
            "name": "probabilities",
            "parameters": {"shared_memory_region": "shared", "shared_memory_byte_size": 4096},
        }
    ]
    try:
        answers = rest.calls(
            [
                ("POST", "/v2/models/mlp/infer", infer_body("mine", array), {}),
                ("GET", "/v2/systemsharedmemory/region/mine/status", None, {}),
                register("stolen", secret),
                register("shared", readable),
                ("POST", "/v2/models/mlp/infer", written_back, {}),
                ("POST", "/v2/models/mlp/infer", infer_body("shared", array), {}),
                ("POST", "/v2/systemsharedmemory/unregister", None, {}),
            ],
            uid=NOBODY,
        )
        everyone = rest.server.stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
    finally:
        rest.server.stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest())
    unknown, status, stolen, shared, write_back, read, unregistered = answers
    assert unknown[0] == status[0] == 404 and "'mine' is not registered" in unknown[1]
    assert stolen[0] == 400 and "uid 65534, another user, may not read" in stolen[1]
    assert shared[0] == 200
    assert write_back[0] == 400 and "takes no output" in write_back[1]
    assert read[0] == 200  # reading is what it may do
    assert unregistered[0] == 200  # all of its own
    assert set(everyone.regions) == {"mine"}  # root's stays root's
    assert readable.read(array.nbytes + 4) == array.tobytes() + bytes(4)  # nothing written


def test_off_refuses_every_shared_memory_route(servers: dict[str, Rest]) -> None:
    array = example_inputs("mlp", seed=23)["input"]
    answers = servers["off"].calls(
        [
            ("GET", "/v2/systemsharedmemory/status", None, {}),
            ("POST", "/v2/systemsharedmemory/unregister", None, {}),
            ("GET", "/v2/cudasharedmemory/status", None, {}),
            ("POST", "/v2/models/mlp/infer", infer_body("r", array), {}),
        ]
    )
    for status, body in answers:
        assert (status, json.loads(body)["error"].split(" (")[0]) == (
            400,
            "system shared memory is off on this server",
        )


def test_the_restricted_category_covers_the_routes_and_requests_naming_a_region(
    servers: dict[str, Rest], segments: list[Segment]
) -> None:
    rest = servers["restricted"]
    key = {"admin-key": "let-me-in"}
    array = example_inputs("mlp", seed=24)["input"]
    segment = Segment(4096)
    segments.append(segment)
    segment.write(array.tobytes())
    body = infer_body("r", array)
    answers = rest.calls(
        [
            ("GET", "/v2/systemsharedmemory/status", None, {}),
            ("POST", "/v2/cudasharedmemory/unregister", None, {}),
            ("POST", register("r", segment)[1], register("r", segment)[2], key),
            ("POST", "/v2/models/mlp/infer", body, {}),
            ("POST", "/v2/models/mlp/infer", body, key),
            ("POST", "/v2/systemsharedmemory/unregister", None, key),
        ]
    )
    status, cuda, registered, refused, served, unregistered = answers
    assert status[0] == cuda[0] == 403 and "expecting header 'admin-key'" in status[1]
    assert registered[0] == 200
    assert refused[0] == 403
    assert "expecting header 'admin-key'" in refused[1] and "shared-memory regions" in refused[1]
    assert served[0] == unregistered[0] == 200


def test_an_input_takes_at_most_a_bodys_bytes_from_a_region(
    servers: dict[str, Rest], segments: list[Segment]
) -> None:
    """A BYTES input's byte size is what it says: more than --http-max-input-size is refused
    before the region is read; exactly that much is read (and then found too short for its
    elements, as it would be in a body)."""
    rest = servers["plain"]
    segment = Segment(MAX_INPUT + 1)
    segments.append(segment)
    status, _ = rest.calls([register("big", segment, MAX_INPUT + 1)])[0]
    assert status == 200

    def body(size: int) -> dict[str, Any]:
        placement = {"shared_memory_region": "big", "shared_memory_byte_size": size}
        tensors = [
            {"name": f"INPUT{i}", "datatype": "BYTES", "shape": [1, 16], "parameters": placement}
            for i in range(2)
        ]
        return {"inputs": tensors}

    try:
        over, exact = rest.calls(
            [
                ("POST", "/v2/models/simple_string/infer", body(MAX_INPUT + 1), {}),
                ("POST", "/v2/models/simple_string/infer", body(MAX_INPUT), {}),
            ]
        )
    finally:
        rest.calls([("POST", "/v2/systemsharedmemory/region/big/unregister", None, {})])
    assert over[0] == 429
    assert f"more than {MAX_INPUT} bytes in shared memory (--http-max-input-size)" in over[1]
    assert exact[0] == 400 and "--http-max-input-size" not in exact[1]
