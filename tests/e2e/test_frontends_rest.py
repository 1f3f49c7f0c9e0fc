"""REST through `--frontends 2`: both front-end processes listen on the REST port (TCP and,
for HTTP/3, UDP; SO_REUSEPORT); an infer request on a version a front-end queues for itself is
served there, straight into the worker's queues (the parent held still by SIGSTOP does not stop
it), as is one asking for classes or naming shared-memory regions (the parent gives each
front-end a copy of every region), and every other request is passed to the parent, which
serves it as a single process does. Every call's answer is compared
with in-process Paddle's for its own inputs; a client that leaves, over TCP or HTTP/3, stops its
generation in the parent."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format

from protos.inference import model_config_pb2 as mc
from tests.e2e.test_frontends import calls_by_frontend, frontends, metrics
from tests.e2e.test_http import (
    leaving_client_stops_its_generation,
    raw,
    response,
    whole_chunked_body_refused,
)
from tests.e2e.test_http3_rest import (
    HTTP3,
    Served,
    check_infer,
    connect,
    curl,
    infer_body,
    leave_a_generation,
)
from tests.e2e.test_shared_memory import Segment
from tests.e2e.test_zero_rtt import stats
from tests.reference import call_inputs, output_names, run_ensemble_reference, run_reference
from tests.servers import (
    HTTP_PORT,
    TWICE,
    eventually,
    model_repository,
    paused,
    refused_start,
    running_server,
    twice_ensemble,
)

pytestmark = pytest.mark.e2e

MAX_CONNECTIONS = 200  # new connections tried until both front-ends passed one on
MAX_INPUT = 1 << 20  # --http-max-input-size


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("frontends_rest")
    args = [
        *("--frontends", "2", "--certs-dir", str(certs_dir)),
        *("--http-port", HTTP_PORT, "--http-max-input-size", str(MAX_INPUT)),
    ]
    repository = model_repository(root / "models", ["mlp", "generate"])
    twice_ensemble(repository, output_names("mlp")[0])
    with running_server(repository, root / "log", args) as server:
        yield Served(server, server.http_port, certs_dir / "ca.pem")


def post(served: Served, path: str, document: Any) -> tuple[int, Any]:
    """One request on a connection of its own (so the kernel picks a front-end for it)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{served.port}{path}",
        data=json.dumps(document).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = response.read()
            return response.status, json.loads(answer) if answer else None  # a register's
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def infer_checked(served: Served, call: int) -> None:
    ((name, array),) = call_inputs("mlp", call).items()
    entry = {"name": name, "datatype": "FP32", "shape": list(array.shape), "data": array.tolist()}
    status, answer = post(served, "/v2/models/mlp/infer", {"id": str(call), "inputs": [entry]})
    assert status == 200, answer
    assert (answer["model_name"], answer["id"]) == ("mlp", str(call))
    expected = run_reference("mlp", {name: array})
    assert {o["name"] for o in answer["outputs"]} == set(expected)
    for output in answer["outputs"]:
        values = np.array(output["data"], np.float32).reshape(output["shape"])
        np.testing.assert_allclose(values, expected[output["name"]], rtol=1e-5, atol=1e-6)


def infers_counted(served: Served) -> float:
    """REST ModelInfer calls answered OK, in the parent's /metrics."""
    return sum(
        s.value
        for s in served.server.metrics()
        if s.name == "paddlequic_requests_total"
        and (s.labels["transport"], s.labels["rpc"], s.labels["code"])
        == ("http", "ModelInfer", "OK")
    )


def served_here(served: Served) -> dict[str, float]:
    """The REST ModelInfer calls each front-end served itself."""
    pattern = r'paddlequic_frontend_served_calls_total{frontend="(\d+)",transport="http"} (\S+)'
    return {i: float(count) for i, count in re.findall(pattern, metrics(served.server))}


def test_rest_infer_calls_are_served_by_both_frontends_and_answer_as_paddle(
    served: Served,
) -> None:
    before = infers_counted(served)
    passed_on = sum(calls_by_frontend(served.server, "http").values())
    calls = 0
    while set(served_here(served)) != {"0", "1"}:
        assert calls < MAX_CONNECTIONS, "new REST connections reached one front-end only"
        infer_checked(served, calls)
        calls += 1
    # Served by each front-end's own infer route: counted there, summed into the parent's
    # /metrics with REST's transport label; none passed on.
    assert infers_counted(served) == before + calls
    assert sum(served_here(served).values()) >= calls
    assert sum(calls_by_frontend(served.server, "http").values()) == passed_on


def test_rest_infer_calls_are_answered_with_the_parent_stopped(served: Served) -> None:
    for call in range(4):  # each front-end's queues attached
        infer_checked(served, 100 + call)
    with paused(served.server.process.pid):
        for call in range(4):
            infer_checked(served, 200 + call)


def test_rest_infer_on_an_ensemble_of_queued_steps_is_answered_with_the_parent_stopped(
    served: Served,
) -> None:
    """An ensemble whose every step a front-end queues for is run by the front-end's own
    infer route too: each output its step's, the parent held still."""
    config = text_format.Parse(TWICE.format(out=output_names("mlp")[0]), mc.ModelConfig())
    with paused(served.server.process.pid):
        for call in range(4):
            ((_, array),) = call_inputs("mlp", 300 + call).items()
            entry = {"name": "x", "datatype": "FP32", "shape": list(array.shape)}
            status, answer = post(
                served, "/v2/models/twice/infer", {"inputs": [{**entry, "data": array.tolist()}]}
            )
            assert status == 200, answer
            expected = run_ensemble_reference(config, {"x": array})
            got = {
                o["name"]: np.array(o["data"], np.float32).reshape(o["shape"])
                for o in answer["outputs"]
            }
            assert set(got) == set(expected)
            for name, values in got.items():
                np.testing.assert_allclose(values, expected[name], rtol=1e-5, atol=1e-6)


def test_a_request_asking_for_classes_is_served_by_the_front_end(served: Served) -> None:
    """The view carries each version's labels (this mlp has none): a front-end ranks the
    classes itself, as the single process does, with the parent held still."""
    ((name, array),) = call_inputs("mlp", 7).items()
    entry = {"name": name, "datatype": "FP32", "shape": list(array.shape), "data": array.tolist()}
    output = run_reference("mlp", {name: array})
    (output_name,) = output
    body = {
        "inputs": [entry],
        "outputs": [{"name": output_name, "parameters": {"classification": 2}}],
    }
    for _ in range(4):  # each front-end's queues attached
        infer_checked(served, 0)
    here = sum(served_here(served).values())
    passed_on = sum(calls_by_frontend(served.server, "http").values())
    with paused(served.server.process.pid):
        status, answer = post(served, "/v2/models/mlp/infer", body)
    assert status == 200, answer
    (classes,) = answer["outputs"]
    assert classes["datatype"] == "BYTES" and classes["shape"] == [array.shape[0], 2]
    best = np.argsort(-output[output_name], axis=1)[:, :2]
    ranked = [int(c.split(":")[1]) for c in classes["data"]]  # "score:index", row by row
    assert ranked == best.ravel().tolist()
    assert sum(served_here(served).values()) == here + 1
    assert sum(calls_by_frontend(served.server, "http").values()) == passed_on


def region_infer(served: Served, input_region: str, output_region: str) -> tuple[int, Any]:
    """mlp's call 8: its input read from `input_region`, its output written to
    `output_region`."""
    ((name, array),) = call_inputs("mlp", 8).items()
    (output_name,) = output_names("mlp")
    placed = {"shared_memory_region": input_region, "shared_memory_byte_size": array.nbytes}
    entry = {"name": name, "datatype": "FP32", "shape": list(array.shape), "parameters": placed}
    output = {"shared_memory_region": output_region, "shared_memory_byte_size": REGION_BYTES}
    body = {"inputs": [entry], "outputs": [{"name": output_name, "parameters": output}]}
    return post(served, "/v2/models/mlp/infer", body)


REGION_BYTES = 4096


def test_requests_naming_shared_memory_regions_are_served_by_the_front_ends(
    served: Served,
) -> None:
    """The parent gives each front-end a copy of each region it registers: a request naming
    regions is served by a front-end, with the parent held still, its input read from one
    region and its output written to another; once the region is unregistered, no process
    serves it; a front-end started again is given the regions registered before."""
    ((name, array),) = call_inputs("mlp", 8).items()
    (output_name,) = output_names("mlp")
    expected = run_reference("mlp", {name: array})[output_name]
    source, target = Segment(REGION_BYTES), Segment(REGION_BYTES)
    source.write(array.tobytes())
    registered = []
    try:
        for region, segment in (("in", source), ("out", target)):
            document = {"key": segment.key, "offset": 0, "byte_size": REGION_BYTES}
            path = f"/v2/systemsharedmemory/region/{region}/register"
            assert post(served, path, document)[0] == 200
            registered.append(region)
        for _ in range(4):  # each front-end's queues attached
            infer_checked(served, 0)

        def served_in_frontends() -> None:
            here = sum(served_here(served).values())
            passed_on = sum(calls_by_frontend(served.server, "http").values())
            with paused(served.server.process.pid):
                for _ in range(4):
                    target.write(bytes(REGION_BYTES))
                    status, answer = region_infer(served, "in", "out")
                    assert status == 200, answer
                    (placed,) = answer["outputs"]
                    assert placed["parameters"]["shared_memory_byte_size"] == expected.nbytes
                    written = np.frombuffer(target.read(expected.nbytes), np.float32)
                    np.testing.assert_allclose(
                        written.reshape(expected.shape), expected, rtol=1e-5, atol=1e-6
                    )
            assert sum(served_here(served).values()) == here + 4
            assert sum(calls_by_frontend(served.server, "http").values()) == passed_on

        served_in_frontends()
        old = frontends(served.server)
        for pid in old:
            os.kill(pid, signal.SIGKILL)
        eventually(lambda: len(frontends(served.server) - old) == 2, "both front-ends restarted")
        served.server.wait_ready()
        eventually(lambda: all_served_here(served), "the restarted front-ends serve regions")
        served_in_frontends()
        status, _ = post(served, "/v2/systemsharedmemory/region/in/unregister", {})
        assert status == 200
        registered.remove("in")
        for _ in range(4):  # on either front-end: none holds it, the parent answers
            status, answer = region_infer(served, "in", "out")
            assert status == 404 and "'in' is not registered" in answer["error"], answer
    finally:
        for region in registered:
            post(served, f"/v2/systemsharedmemory/region/{region}/unregister", {})
        for segment in (source, target):
            segment.path.unlink(missing_ok=True)


def all_served_here(served: Served) -> bool:
    """Whether requests naming regions, 8 in a row (on either front-end), were served by
    front-ends (a front-end started moments ago may not hold the copies yet)."""
    passed_on = sum(calls_by_frontend(served.server, "http").values())
    for _ in range(8):
        assert region_infer(served, "in", "out")[0] == 200
    return sum(calls_by_frontend(served.server, "http").values()) == passed_on


def test_errors_and_bounds_are_the_parents(served: Served) -> None:
    status, answer = post(served, "/v2/models/nope/infer", {"inputs": []})
    assert status == 404 and "unknown model" in answer["error"]
    # Only the headers: a body the server refuses unread would race its answer (a reset).
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as connection:
        connection.sendall(
            b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n"
            + f"Content-Length: {MAX_INPUT + 1}\r\n\r\n".encode()
        )
        status, body = response(connection)
    assert status == 400 and "--http-max-input-size" in json.loads(body)["error"]
    with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/v2/health/ready") as ready:
        assert (ready.status, json.loads(ready.read())) == (200, {"ready": True})


def test_a_client_that_sends_its_whole_chunked_body_first_reads_the_400(served: Served) -> None:
    """The infer request is the front-end's own: it refuses the body once past the limit and
    lingers, as a single process does (a request passed on to the parent was seen to leave
    such a client waiting)."""
    whole_chunked_body_refused(served.port, MAX_INPUT)


def test_a_stream_whose_client_leaves_stops_generating(served: Served) -> None:
    """The client reads one event of a 250-token generation and closes its connection: the
    front-end cancels the call and the parent's generation stops far short of 250 steps."""
    leaving_client_stops_its_generation(served.server, served.port)


def test_a_rest_port_another_process_holds_stops_the_start(tmp_path: Path, certs_dir: Path) -> None:
    """Front-ends would fail to listen, and be restarted again and again: the parent holds
    the REST port before starting them, and a port taken stops the start, naming it."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        repository = model_repository(tmp_path / "models", [])
        args = ["--model-repository", str(repository), "--certs-dir", str(certs_dir)]
        args += ["--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "0"]
        args += ["--http-port", str(port), "--frontends", "2"]
        refused = refused_start(args)
    assert f"TCP port {port} (REST): Address already in use" in refused


def test_curl_over_http3_through_frontends_answers_as_paddle(served: Served) -> None:
    """On the REST port's number and on the gRPC HTTP/3 port alike."""
    calls: list[tuple[str, str, str | None]] = [
        (f"https://localhost:{port}/v2/models/mlp/infer", "3", infer_body(call))
        for call, port in ((1000, served.port), (1001, served.server.port))
    ]
    for call, (status, version, _, body) in zip((1000, 1001), curl(served, calls), strict=True):
        assert (status, version) == (200, HTTP3), body
        check_infer(body, call)


async def test_an_http3_client_that_leaves_stops_its_generation(served: Served) -> None:
    await leave_a_generation(served, "resets its stream")


async def test_the_rest_ports_http3_connections_are_counted(served: Served) -> None:
    """Each front-end reports its REST port's HTTP/3 counters with its gRPC port's."""
    before = stats(served.server).h3_connections
    connection = await connect(served)
    await connection.close()
    assert stats(served.server).h3_connections == before + 1


HOST_REQUESTS = 4  # --max-concurrent-rpcs of the server below
PROBES = 8


def test_the_rest_limit_is_the_host_s(tmp_path: Path) -> None:
    """Requests held reading their bodies on connections of their own (so on either
    front-end), half of them infer requests served there, half passed on to the parent,
    HOST_REQUESTS in all: requests on PROBES more connections in a row are refused 429,
    whichever front-end takes each, and requests are served again once the held ones are
    gone."""
    args = [
        *("--frontends", "2", "--no-h3", "--http-port", HTTP_PORT),
        *("--max-concurrent-rpcs", str(HOST_REQUESTS)),
    ]
    repository = model_repository(tmp_path / "models", ["mlp"])
    with running_server(repository, tmp_path / "log", args) as server:
        rest = Served(server, server.http_port, Path())

        def hold(index: int) -> socket.socket:
            path = "/v2/models/mlp/infer" if index % 2 else "/v2/repository/index"
            waiting = raw(rest).socket
            waiting.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n{{".encode()
            )
            return waiting

        def live() -> tuple[int, bytes]:
            with raw(rest) as connection:
                connection.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
                return response(connection)

        held = [hold(index) for index in range(HOST_REQUESTS)]
        try:
            # Until PROBES in a row are refused. A front-end counts a probe it passed on until
            # its answer is sent, so probes may take a held request's place while its headers
            # are still unread: it is refused (its socket has an answer) and held anew.
            deadline, refused = time.monotonic() + 60, 0
            while refused < PROBES:
                assert time.monotonic() < deadline, f"{refused} refused in a row at most"
                answered, _, _ = select.select(held, [], [], 0)
                for waiting in answered:
                    index = held.index(waiting)
                    waiting.close()
                    held[index], refused = hold(index), 0
                status, body = live()
                if status != 429:
                    refused = 0
                    continue
                assert f"at most {HOST_REQUESTS} REST requests" in json.loads(body)["error"]
                refused += 1
        finally:
            for waiting in held:
                waiting.close()
        deadline = time.monotonic() + 30
        while live()[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
