"""--instance-queues: a request goes straight into a shared-memory queue of one instance and the
worker batches for itself. What only this path has: its bounds (the queue's count, a ring's
bytes), and its trust boundary (a worker that scribbles over its queues fails only its own
requests). What both paths promise is tested on both: test_watchdog.py (deaths, the watchdog,
poison) and test_batching.py (batches formed, bad values alone, cancellation).

Its own server: it pauses and breaks workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import text_format

from clients.inference_client import build_request
from oip.bytes_tensor import deserialize_bytes
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.inference import model_config_pb2 as mc
from protos.paddlequic.v1 import control_pb2
from service.api.stream_inference import STREAM_WINDOW
from tests.e2e.test_decoupled import MODEL as REPEAT
from tests.e2e.test_decoupled import decoupled_repository, final_flag, index_of, repeat
from tests.e2e.test_worker_restart import only_instance, wait_for
from tests.reference import (
    assert_matches_reference,
    assert_outputs,
    example_inputs,
    output_names,
    run_ensemble_reference,
    run_reference,
)
from tests.servers import (
    EXAMPLE_MODELS,
    HTTP_PORT,
    TWICE,
    ServerProcess,
    descendants,
    paused,
    running_server,
    twice_ensemble,
    wait_arrived,
)

RPC_TIMEOUT_S = 120.0
# Looked at while idle: 1% of a core is then 10 ticks of 100 a second. CPU time is counted a
# tick at a time (here /proc's schedstat reads 0), so a short span is noisy: over 4 s two
# front-ends' idle tree spent 0 to 3 ticks, about 0.4% of a core on average.
IDLE_S = 10
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # new connections: both front-ends
SCRIBBLE = 17.0
STALL_S = 1.0  # --stream-stall-timeout
STALLED_REQUESTS = 400
WINDOW_LOOKS = 20
QUEUE_MB = 1  # rings of 512 KiB: one request takes at most 256 KiB
CONFIG = """
max_batch_size: {rows}
input [ {{ name: "input", data_type: TYPE_FP32, dims: [ {dims} ] }} ]
output [ {{ name: "{output}", data_type: TYPE_FP32, dims: [ {out} ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
dynamic_batching {{ default_queue_policy {{ max_queue_size: {queue} }} }}
parameters {{ key: "testing_scribble_on" value: {{ string_value: "{scribble}" }} }}
"""


def add_mlp(root: Path, name: str, rows: int, queue: int, variable: bool = False) -> None:
    """`variable`: no batching, the rows a dimension of its own (its size unknown until a
    request comes)."""
    model = root / name
    model.mkdir(parents=True)
    (model / "1").symlink_to(EXAMPLE_MODELS / "mlp" / "1")
    dims, out = ("-1, 256", "-1, 10") if variable else ("256", "10")
    output = output_names("mlp")[0]
    config = CONFIG.format(
        rows=rows, queue=queue, output=output, scribble=SCRIBBLE, dims=dims, out=out
    )
    (model / "config.pbtxt").write_text(config)


LABELS = [f"class-{index}" for index in range(10)]


def add_labelled(root: Path) -> None:
    """mlp whose output has a label_filename (the classification extension)."""
    add_mlp(root, "labelled", 8, 64)
    config = root / "labelled" / "config.pbtxt"
    labelled = config.read_text().replace(
        "dims: [ 10 ] }", 'dims: [ 10 ], label_filename: "labels.txt" }'
    )
    assert labelled != config.read_text()
    config.write_text(labelled)
    (root / "labelled" / "labels.txt").write_text("".join(f"{label}\n" for label in LABELS))


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "frontends-2"])
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    """One process, and two front-ends that write into the workers' queues themselves."""
    root = tmp_path_factory.mktemp("queues")
    add_mlp(root / "models", "mlp", 8, 64)
    add_mlp(root / "models", "small_queue", 2, 2)
    add_mlp(root / "models", "wide", 512, 64)
    add_mlp(root / "models", "variable", 0, 64, variable=True)
    add_mlp(root / "models", "counted", 8, 64)
    add_labelled(root / "models")
    twice_ensemble(root / "models", output_names("mlp")[0])
    decoupled_repository(root / "models")
    args = ["--instance-queues", "--instance-queue-mb", str(QUEUE_MB), "--testing-service"]
    args += ["--stream-stall-timeout", str(STALL_S)]
    args += ["--frontends", str(request.param), "--http-port", HTTP_PORT]
    with running_server(root / "models", root / "server.log", args) as process:
        yield process


def one_row(seed: int) -> dict[str, Any]:
    return {"input": np.random.default_rng(seed).standard_normal((1, 256), np.float32)}


def call(server: ServerProcess, model: str, inputs: dict[str, Any], timeout: float) -> Any:
    return server.stub.ModelInfer.future(build_request(model, inputs), timeout=timeout)


def test_a_full_queue_answers_resource_exhausted_at_once(server: ServerProcess) -> None:
    """max_queue_size 2 and one instance of max_batch_size 2: the server holds 4, the fifth
    is refused while the worker is held still, and the four are answered once it moves."""
    inputs = one_row(1)
    with paused(only_instance(server, "small_queue").pid):
        held = [call(server, "small_queue", inputs, RPC_TIMEOUT_S) for _ in range(4)]
        wait_arrived(server, "small_queue", 4)
        with pytest.raises(grpc.RpcError) as refused:
            server.stub.ModelInfer(build_request("small_queue", inputs), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the queue holds its maximum of 2 requests" in (refused.value.details() or "")
    for answer in held:
        assert_matches_reference("mlp", inputs, answer.result())


def test_a_full_batch_fits_a_ring_and_a_variable_request_past_it_is_refused(
    server: ServerProcess,
) -> None:
    """Where the config fixes a request's size, the rings take a full batch whatever
    --instance-queue-mb says (512 rows of 1 KiB: twice a quarter of 1 MiB); where it does
    not, a request past a quarter of it is refused, naming the option."""
    full = {"input": np.ones((512, 256), np.float32)}
    assert_matches_reference("mlp", full, server.stub.ModelInfer(build_request("wide", full)))
    inputs = {"input": np.ones((300, 256), np.float32)}  # 300 KiB
    with pytest.raises(grpc.RpcError) as refused:
        server.stub.ModelInfer(build_request("variable", inputs), timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--instance-queue-mb" in (refused.value.details() or "")
    fits = {"input": np.ones((200, 256), np.float32)}
    answer = server.stub.ModelInfer(build_request("variable", fits))
    assert_matches_reference("mlp", fits, answer)


def test_requests_that_find_the_ring_full_wait_for_room_and_are_answered(
    server: ServerProcess,
) -> None:
    """Rings of 512 KiB take two requests of 200 KiB: while the worker is held still, the
    other three wait in the process holding them (counted as queued), not refused, and go in
    as the worker takes records."""
    inputs = [
        {"input": np.random.default_rng(seed).standard_normal((200, 256), np.float32)}
        for seed in range(5)
    ]
    with paused(only_instance(server, "variable").pid):
        held = [call(server, "variable", x, RPC_TIMEOUT_S) for x in inputs]
        wait_arrived(server, "variable", len(held))
    for x, answer in zip(inputs, held, strict=True):
        assert_matches_reference("mlp", x, answer.result())


def test_a_request_finding_others_waiting_for_room_waits_behind_them(
    server: ServerProcess,
) -> None:
    """A one-row request that would fit beside two 200 KiB requests in a ring of 512 KiB does
    not go ahead of a third that waits for room: it waits behind it (it took the room the
    third waits for, which a steady stream of small requests would starve), the instance
    holds two until the worker moves, and the third is answered before it."""
    big = [
        {"input": np.random.default_rng(40 + seed).standard_normal((200, 256), np.float32)}
        for seed in range(3)
    ]
    small = {"input": np.random.default_rng(43).standard_normal((1, 256), np.float32)}
    answered: list[str] = []
    with paused(only_instance(server, "variable").pid):
        held = [call(server, "variable", x, RPC_TIMEOUT_S) for x in big]
        wait_arrived(server, "variable", len(held))
        held.append(call(server, "variable", small, RPC_TIMEOUT_S))
        wait_arrived(server, "variable", len(held))
        assert only_instance(server, "variable").outstanding == 2
        for name, future in zip(["big0", "big1", "big2", "small"], held, strict=True):
            future.add_done_callback(lambda _, name=name: answered.append(name))
    for x, answer in zip([*big, small], held, strict=True):
        assert_matches_reference("mlp", x, answer.result())
    wait_for("every answer's callback", lambda: True if len(answered) == 4 else None)
    assert answered.index("big2") < answered.index("small")


def test_a_deadline_passing_in_the_worker_queue_leaves_nothing_behind(
    server: ServerProcess,
) -> None:
    inputs = example_inputs("mlp", seed=2)
    with paused(only_instance(server, "mlp").pid), pytest.raises(grpc.RpcError) as late:
        server.stub.ModelInfer(build_request("mlp", inputs), timeout=0.5)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_matches_reference("mlp", inputs, server.stub.ModelInfer(build_request("mlp", inputs)))
    wait_for("the expired request to leave the queue", lambda: True if held(server) == 0 else None)


def held(server: ServerProcess) -> int:
    """Requests of mlp the server holds: in the worker's queue or in a batch."""
    request = control_pb2.ListInstancesRequest(model_name="mlp")
    (queue,) = server.control.ListInstances(request, timeout=5).queues
    return int(queue.queued + queue.in_flight)


def test_a_worker_scribbling_over_its_queues_fails_only_its_own_requests(
    server: ServerProcess,
) -> None:
    """Random bytes over all of the worker's shared memory: the server finds them at its next
    read, kills the worker as misbehaving and fails the requests it held (not run again, as
    for any protocol breach); the other models' requests are untouched and the model serves
    again once the worker has restarted."""
    before = only_instance(server, "mlp")
    bad = example_inputs("mlp", seed=3)
    bad["input"][0, 5] = SCRIBBLE
    others = [one_row(10 + i) for i in range(4)]
    with paused(before.pid):
        victim = call(server, "mlp", bad, RPC_TIMEOUT_S)
        wait_arrived(server, "mlp", 1)
        good = [call(server, "small_queue", x, RPC_TIMEOUT_S) for x in others[:2]]
    error = victim.exception(timeout=RPC_TIMEOUT_S)
    assert isinstance(error, grpc.Call), "the scribbling worker's request was answered"
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "broke the worker protocol" in (error.details() or "")
    assert "the request is not run again" in (error.details() or "")
    for x, answer in zip(others, good, strict=False):
        assert_matches_reference("mlp", x, answer.result())
    after = wait_for(
        "the scribbling worker to be replaced",
        lambda: (
            i
            if (i := only_instance(server, "mlp")).state == "READY" and i.pid != before.pid
            else None
        ),
    )
    assert after.restarts == before.restarts + 1
    assert not os.path.exists(f"/proc/{before.pid}") or _zombie(before.pid)
    for x in others:
        assert_matches_reference("mlp", x, server.stub.ModelInfer(build_request("mlp", x)))
    assert "wrote a bad reply into its queue" in server.log_text()
    assert server.process.poll() is None


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0] == "Z"


def test_an_idle_worker_sleeps_in_the_kernel(server: ServerProcess) -> None:
    """Nothing polls: a worker waiting on its queues spends no CPU (it sleeps in poll() on
    its wake-up descriptor), and wakes for the next request."""
    pid = only_instance(server, "mlp").pid
    inputs = example_inputs("mlp", seed=4)
    assert_matches_reference("mlp", inputs, server.stub.ModelInfer(build_request("mlp", inputs)))
    before = cpu_ticks(pid)
    time.sleep(2.0)  # a span to look at, not a timing asserted on
    assert cpu_ticks(pid) - before <= 1, "the idle worker kept running"
    assert_matches_reference("mlp", inputs, server.stub.ModelInfer(build_request("mlp", inputs)))


def test_an_idle_server_uses_under_one_percent_of_a_core(server: ServerProcess) -> None:
    """Issue #43's bound for the whole tree (parent, front-ends, launchers, workers):
    everything that waits, waits in the kernel; what wakes by a timer (the metrics server's
    shutdown poll, the watchdogs) costs well under 1% of a core."""
    inputs = example_inputs("mlp", seed=5)
    assert_matches_reference("mlp", inputs, server.stub.ModelInfer(build_request("mlp", inputs)))
    pids = [server.process.pid, *descendants(server.process.pid)]
    before = sum(cpu_ticks(pid) for pid in pids)
    time.sleep(IDLE_S)  # a span to look at, not a timing asserted on
    spent = sum(cpu_ticks(pid) for pid in pids) - before
    ticks = os.sysconf("SC_CLK_TCK")
    assert spent <= ticks * IDLE_S / 100, f"{spent} ticks of {ticks}/s in {IDLE_S} s"


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def test_front_ends_answer_model_infer_with_their_parent_stopped(
    server: ServerProcess, request: pytest.FixtureRequest
) -> None:
    """With --frontends 2 the parent takes no part in a ModelInfer call: held still by
    SIGSTOP, it cannot pass anything on, and every call is still answered (each front-end
    writes into the worker's queues and reads its answers itself)."""
    if "one-process" in request.node.callspec.id:
        pytest.skip("the parent is the process holding the calls")
    channels = [grpc.insecure_channel(server.address) for _ in range(4)]
    try:
        stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]
        inputs = [example_inputs("mlp", seed=20 + i) for i in range(len(stubs))]
        for stub, x in zip(stubs, inputs, strict=True):  # each front-end's queues attached
            assert_matches_reference("mlp", x, stub.ModelInfer(build_request("mlp", x)))
        with paused(server.process.pid):
            for stub, x in zip(stubs, inputs, strict=True):
                answer = stub.ModelInfer(build_request("mlp", x), timeout=RPC_TIMEOUT_S)
                assert_matches_reference("mlp", x, answer)
    finally:
        for channel in channels:
            channel.close()


def test_front_ends_stream_a_decoupled_models_responses_with_their_parent_stopped(
    server: ServerProcess, request: pytest.FixtureRequest
) -> None:
    """With --frontends 2 a decoupled model's responses do not cross the parent: each
    front-end sends the worker its requests on a socket of its own and reads their
    responses itself. Held still by SIGSTOP, the parent passes nothing on, and every
    stream's requests still get each of their responses, in order, the last one final."""
    if "one-process" in request.node.callspec.id:
        pytest.skip("the parent is the process holding the calls")
    channels = [grpc.insecure_channel(server.address, OWN_CONNECTION) for _ in range(4)]

    def stream(stub: pb_grpc.GRPCInferenceServiceStub, name: str) -> dict[str, list[Any]]:
        asked = {f"{name}-a": 5, f"{name}-b": 3}
        requests = [repeat(count, request_id) for request_id, count in asked.items()]
        responses = stub.ModelStreamInfer(iter(requests), timeout=RPC_TIMEOUT_S)
        seen: dict[str, list[Any]] = {request_id: [] for request_id in asked}
        for response in responses:
            assert not response.error_message, response.error_message
            seen[response.infer_response.id].append((index_of(response), final_flag(response)))
        for request_id, count in asked.items():
            assert seen[request_id] == [(i, i == count - 1) for i in range(count)]
        return seen

    try:
        stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]
        for n, stub in enumerate(stubs):  # each front-end's socket attached to the worker
            stream(stub, f"warm{n}")
        before = stream_requests_ran(server)
        with paused(server.process.pid):
            for n, stub in enumerate(stubs):
                stream(stub, f"held{n}")
    finally:
        for channel in channels:
            channel.close()
    after = stream_requests_ran(server)
    assert after["here"] - before["here"] == 2 * len(stubs)
    assert after.get("parent", 0) == before.get("parent", 0)


def test_front_ends_answer_rest_generate_with_their_parent_stopped(
    server: ServerProcess, request: pytest.FixtureRequest
) -> None:
    """REST's generate routes on a version a front-end serves itself are answered there:
    generate_stream on the decoupled model, its events read from the front-end's own socket
    to the worker, and generate on a queued one, with the parent held still (each request a
    new connection, whichever front-end it reaches)."""
    if "one-process" in request.node.callspec.id:
        pytest.skip("the parent is the process holding the calls")
    port = re.findall(r"KServe v2 REST over [^\"]* on 127\.0\.0\.1:(\d+)", server.log_text())[0]
    url = f"http://127.0.0.1:{port}/v2/models"

    def post(path: str, body: dict[str, Any]) -> bytes:
        sent = urllib.request.Request(f"{url}/{path}", json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(sent, timeout=RPC_TIMEOUT_S) as answer:
            return bytes(answer.read())

    def generated(count: int) -> list[int]:
        payload = post(f"{REPEAT}/generate_stream", {"count": count, "delay_ms": 0, "mode": ""})
        events = [e for e in payload.split(b"\n\n") if e.strip()]
        return [json.loads(e.removeprefix(b"data: "))["index"] for e in events]

    row = one_row(60)
    generated(2)  # each front-end's socket attached before the parent stops
    with paused(server.process.pid):
        for count in range(1, 6):
            assert generated(count) == list(range(count))
        answer = json.loads(post("mlp/generate", {"input": row["input"].ravel().tolist()}))
    (name,) = output_names("mlp")
    expected = run_reference("mlp", {"input": row["input"]})[name]
    np.testing.assert_allclose(answer[name], expected.ravel(), rtol=1e-4, atol=1e-6)


def test_front_ends_run_an_ensemble_of_queued_steps_with_their_parent_stopped(
    server: ServerProcess, request: pytest.FixtureRequest
) -> None:
    """An ensemble whose steps front-ends queue for themselves is run there too: answered
    with the parent held still, each output its step's, and counted once."""
    config = text_format.Parse(TWICE.format(out=output_names("mlp")[0]), mc.ModelConfig())
    one = "one-process" in request.node.callspec.id
    inputs = [{"x": one_row(40 + i)["input"]} for i in range(4)]
    channels = [grpc.insecure_channel(server.address, OWN_CONNECTION) for _ in inputs]
    try:
        stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]
        stubs[0].ModelInfer(build_request("twice", inputs[0]), timeout=RPC_TIMEOUT_S)
        with contextlib.nullcontext() if one else paused(server.process.pid):
            for stub, x in zip(stubs, inputs, strict=True):
                answer = stub.ModelInfer(build_request("twice", x), timeout=RPC_TIMEOUT_S)
                assert_outputs(run_ensemble_reference(config, x), answer)
    finally:
        for channel in channels:
            channel.close()
    request_stats = pb.ModelStatisticsRequest(name="twice")
    (stats,) = server.stub.ModelStatistics(request_stats, timeout=RPC_TIMEOUT_S).model_stats
    assert stats.inference_stats.success.count == 1 + len(inputs)


def stream(channel: grpc.Channel, requests: list[pb.ModelInferRequest]) -> dict[str, Any]:
    """A ModelStreamInfer of `requests`, read whole: its responses by request id."""
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    answers = list(stub.ModelStreamInfer(iter(requests), timeout=RPC_TIMEOUT_S))
    by_id = {a.infer_response.id: a for a in answers}
    assert len(by_id) == len(answers) == len(requests)
    return by_id


def test_front_ends_answer_a_stream_with_their_parent_stopped(
    server: ServerProcess, request: pytest.FixtureRequest
) -> None:
    """A ModelStreamInfer request on a version a front-end queues for itself runs there too:
    with the parent held still, every request of the stream is answered, each with its own
    outputs."""
    one = "one-process" in request.node.callspec.id
    inputs = [one_row(50 + i) for i in range(6)]
    requests = [build_request("mlp", x, request_id=str(i)) for i, x in enumerate(inputs)]
    with grpc.insecure_channel(server.address, OWN_CONNECTION) as channel:
        stream(channel, requests[:1])  # this front-end's queues attached
        with contextlib.nullcontext() if one else paused(server.process.pid):
            by_id = stream(channel, requests)
    for index, x in enumerate(inputs):
        answer = by_id[str(index)]
        assert not answer.error_message
        assert_matches_reference("mlp", x, answer.infer_response)


def classes_asked(inputs: dict[str, Any], k: int, request_id: str = "") -> pb.ModelInferRequest:
    asked = build_request("labelled", inputs, request_id=request_id)
    output = asked.outputs.add(name=output_names("mlp")[0])
    output.parameters["classification"].int64_param = k
    return asked


def assert_top_classes(inputs: dict[str, Any], k: int, answer: pb.ModelInferResponse) -> None:
    """Each row's `k` best classes, best first, as `score:index:label` (Triton's texts)."""
    name = output_names("mlp")[0]
    expected = run_reference("mlp", {"input": inputs["input"]})[name]
    (output,) = answer.outputs
    assert (output.name, output.datatype, list(output.shape)) == (name, "BYTES", [len(expected), k])
    texts = [
        t.decode() for t in deserialize_bytes(answer.raw_output_contents[0], len(expected) * k)
    ]
    for row, ranked in zip(expected, np.array(texts).reshape(len(expected), k), strict=True):
        best = np.argsort(-row, kind="stable")[:k]
        fields = [text.split(":") for text in ranked]
        assert [int(index) for _, index, _ in fields] == best.tolist()
        assert [label for _, _, label in fields] == [LABELS[i] for i in best]
        scores = [float(score) for score, _, _ in fields]
        np.testing.assert_allclose(scores, row[best], rtol=1e-4, atol=1e-5)


def test_classes_are_ranked_where_the_call_is_held_with_the_versions_labels(
    server: ServerProcess, request: pytest.FixtureRequest
) -> None:
    """A request asking for an output's top classes is served by the process holding its
    call, a front-end's included (the view carries each version's labels): ModelInfer, a
    stream's request and a decoupled model's, with the parent held still, each ranked as the
    model's own outputs rank them and labelled from the version's label_filename."""
    one = "one-process" in request.node.callspec.id
    rng = np.random.default_rng(71)
    inputs = [{"input": rng.standard_normal((2, 256), np.float32)} for _ in range(4)]
    channels = [grpc.insecure_channel(server.address, OWN_CONNECTION) for _ in range(4)]
    try:
        stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]
        for stub, x in zip(stubs, inputs, strict=True):  # each front-end's queues attached
            assert_top_classes(x, 3, stub.ModelInfer(classes_asked(x, 3), timeout=RPC_TIMEOUT_S))
        with contextlib.nullcontext() if one else paused(server.process.pid):
            for stub, x in zip(stubs, inputs, strict=True):
                answer = stub.ModelInfer(classes_asked(x, 2), timeout=RPC_TIMEOUT_S)
                assert_top_classes(x, 2, answer)
            by_id = stream(channels[0], [classes_asked(inputs[0], 4, request_id="ranked")])
            # A decoupled model's request: each response's tensor as its top k.
            generated = repeat(3, "ranked-stream", size=4)
            generated.outputs.add(name="data").parameters["classification"].int64_param = 2
            stub = pb_grpc.GRPCInferenceServiceStub(channels[0])
            responses = list(stub.ModelStreamInfer(iter([generated]), timeout=RPC_TIMEOUT_S))
        assert not by_id["ranked"].error_message
        assert_top_classes(inputs[0], 4, by_id["ranked"].infer_response)
        assert [r.error_message for r in responses] == [""] * 3
        for index, response in enumerate(responses):
            (data,) = response.infer_response.outputs
            assert (data.name, data.datatype, list(data.shape)) == ("data", "BYTES", [2])
            ranked = deserialize_bytes(response.infer_response.raw_output_contents[0], 2)
            assert ranked == [f"{index}:0".encode(), f"{index}:1".encode()]
    finally:
        for channel in channels:
            channel.close()


def requests_total(server: ServerProcess, model: str, rpc: str) -> dict[str, float]:
    """paddlequic_requests_total of `model`'s `rpc` calls, by status code."""
    return {
        s.labels["code"]: s.value
        for s in server.metrics()
        if s.name == "paddlequic_requests_total"
        and (s.labels["model"], s.labels["rpc"]) == (model, rpc)
    }


def test_a_stream_runs_what_it_can_here_and_passes_the_rest_on(
    server: ServerProcess, request: pytest.FixtureRequest
) -> None:
    """Requests a front-end does not run itself (a model nobody serves, a shape its model
    refuses) go on to the parent in the stream's part, and their answers join the stream:
    each request answered once, the refusals in the parent's words. The stream is one call,
    counted once under its first request's model, and ModelStatistics counts each request
    where it ran."""
    good = [one_row(60), one_row(61)]
    bad_shape = {"input": np.zeros((1, 255), np.float32)}
    requests = [
        build_request("variable", good[0], request_id="here-0"),
        build_request("nope", good[0], request_id="nobody"),
        build_request("variable", bad_shape, request_id="refused"),
        build_request("variable", good[1], request_id="here-1"),
    ]
    statistics = pb.ModelStatisticsRequest(name="variable", version="1")

    def outcomes() -> tuple[int, int]:
        (stats,) = server.stub.ModelStatistics(statistics, timeout=RPC_TIMEOUT_S).model_stats
        return stats.inference_stats.success.count, stats.inference_stats.fail.count

    before, calls_before = outcomes(), requests_total(server, "variable", "ModelStreamInfer")
    ran_before = stream_requests_ran(server)
    with grpc.insecure_channel(server.address, OWN_CONNECTION) as channel:
        by_id = stream(channel, requests)
    for index, x in enumerate(good):
        answer = by_id[f"here-{index}"]
        assert not answer.error_message
        assert_matches_reference("mlp", x, answer.infer_response)
    assert by_id["nobody"].error_message.startswith("NOT_FOUND: "), by_id["nobody"]
    assert by_id["refused"].error_message.startswith("INVALID_ARGUMENT: "), by_id["refused"]
    assert by_id["refused"].infer_response.model_name == "variable"
    after = outcomes()
    assert (after[0] - before[0], after[1] - before[1]) == (2, 1)
    calls = requests_total(server, "variable", "ModelStreamInfer")
    assert calls.get("OK", 0) - calls_before.get("OK", 0) == 1
    assert sum(calls.values()) - sum(calls_before.values()) == 1
    if "frontends-2" in request.node.callspec.id:  # where a front-end ran each request
        ran = stream_requests_ran(server)
        assert {key: ran[key] - ran_before.get(key, 0) for key in ran} == {"here": 2, "parent": 2}


def stream_requests_ran(server: ServerProcess) -> dict[str, float]:
    """paddlequic_frontend_stream_requests_total, summed over the front-ends, by where the
    requests ran."""
    ran: dict[str, float] = {}
    for sample in server.metrics():
        if sample.name == "paddlequic_frontend_stream_requests_total":
            where = sample.labels["ran"]
            ran[where] = ran.get(where, 0) + sample.value
    return ran


def test_a_stream_holds_at_most_its_window_of_requests(server: ServerProcess) -> None:
    """A stream runs at most STREAM_WINDOW of its requests at once, whichever process holds
    it: with the worker held still, a stream of more puts that many in the instance and reads
    no further (the rest wait in the transport); once the worker runs, every request is
    answered with its own outputs."""
    inputs = [one_row(100 + i) for i in range(STREAM_WINDOW + 20)]
    requests = [build_request("mlp", x, request_id=str(i)) for i, x in enumerate(inputs)]
    with grpc.insecure_channel(server.address, OWN_CONNECTION) as channel:
        stream(channel, requests[:1])  # this front-end's queues attached
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with paused(only_instance(server, "mlp").pid):
            responses = stub.ModelStreamInfer(iter(requests), timeout=RPC_TIMEOUT_S)
            wait_for(
                "the stream's window to fill",
                lambda: only_instance(server, "mlp").outstanding >= STREAM_WINDOW or None,
            )
            # Looked at again and again while nothing runs: never past the window.
            looks = [only_instance(server, "mlp").outstanding for _ in range(WINDOW_LOOKS)]
            assert max(looks) == STREAM_WINDOW, looks
        by_id = {r.infer_response.id: r for r in responses}
    assert sorted(by_id, key=int) == [str(i) for i in range(len(inputs))]
    for index, x in enumerate(inputs):
        assert not by_id[str(index)].error_message
        assert_matches_reference("mlp", x, by_id[str(index)].infer_response)


def stalls(server: ServerProcess) -> float:
    (count,) = [s.value for s in server.metrics() if s.name == "paddlequic_stream_stalls_total"]
    return count


def test_a_stream_whose_caller_stops_reading_ends_at_the_stall_bound(
    server: ServerProcess,
) -> None:
    """Wherever its requests run, a stream whose caller takes nothing for
    --stream-stall-timeout while a response waits ends RESOURCE_EXHAUSTED, naming the bound,
    and the server goes on answering."""
    # Each response repeats its request's id (at most 256 bytes): about 190 fill HTTP/2's
    # window (64 KiB, BDP probing off), then the stream's window, and the server's send waits.
    requests = [
        build_request("mlp", one_row(70), request_id=f"{index:04d}".ljust(256, "x"))
        for index in range(STALLED_REQUESTS)
    ]
    options = [*OWN_CONNECTION, ("grpc.http2.bdp_probe", 0)]
    before = stalls(server)
    with grpc.insecure_channel(server.address, options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        responses = stub.ModelStreamInfer(iter(requests), timeout=RPC_TIMEOUT_S)
        # The stream ends once the transport takes what the server was sending: the bound
        # passing is counted at once.
        wait_for("the stall bound to pass", lambda: stalls(server) > before or None)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in responses:
                pass
    assert ended.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--stream-stall-timeout" in (ended.value.details() or "")
    x = one_row(71)
    assert_matches_reference("mlp", x, server.stub.ModelInfer(build_request("mlp", x)))


def test_model_statistics_and_metrics_count_every_call_once_wherever_it_was_served(
    server: ServerProcess, request: pytest.FixtureRequest
) -> None:
    """A call a front-end serves itself is counted there and reported to the parent, which
    asks every front-end before it answers: ModelStatistics and /metrics show each call
    answered, once, as soon as it is answered, and each front-end's and worker's CPU."""
    channels = [grpc.insecure_channel(server.address, OWN_CONNECTION) for _ in range(4)]
    try:
        for seed, channel in enumerate(channels):
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for _ in range(3):
                stub.ModelInfer(build_request("counted", one_row(seed)), timeout=RPC_TIMEOUT_S)
    finally:
        for channel in channels:
            channel.close()
    asked = pb.ModelStatisticsRequest(name="counted", version="1")
    (stats,) = server.stub.ModelStatistics(asked).model_stats
    assert (stats.inference_count, stats.inference_stats.success.count) == (12, 12)
    assert stats.inference_stats.fail.count == 0
    assert sum(b.compute_infer.count for b in stats.batch_stats) == stats.execution_count
    served = ("counted", "ModelInfer", "OK")
    answered = [
        s.value
        for s in server.metrics()
        if s.name == "paddlequic_requests_total"
        and (s.labels["model"], s.labels["rpc"], s.labels["code"]) == served
    ]
    assert sum(answered) == 12
    # The CPU those calls took: the parent's process_*, and with front-ends each one's own.
    cpu = {
        s.labels["frontend"]: s.value
        for s in server.metrics()
        if s.name == "paddlequic_frontend_cpu_seconds_total"
    }
    assert any(s.name == "process_cpu_seconds_total" for s in server.metrics())
    if "frontends-2" in request.node.callspec.id:
        assert len(cpu) == 2 and all(seconds > 0 for seconds in cpu.values()), cpu
    else:
        assert cpu == {}
    # And each worker's, by instance.
    workers = {
        s.labels["instance"]: s.value
        for s in server.metrics()
        if s.name == "paddlequic_worker_cpu_seconds_total" and s.labels["model"] == "counted"
    }
    assert len(workers) == 1 and all(seconds > 0 for seconds in workers.values()), workers


def test_an_instance_counts_the_requests_every_process_holds_in_it(server: ServerProcess) -> None:
    """ListInstances' outstanding count of an instance includes what front-ends hold in its
    queues (they report it when the parent asks)."""
    inputs = [one_row(30 + i) for i in range(3)]
    with paused(only_instance(server, "mlp").pid):
        held = [call(server, "mlp", x, RPC_TIMEOUT_S) for x in inputs]
        wait_for(
            "the instance to count the requests held in it",
            lambda: True if only_instance(server, "mlp").outstanding == len(held) else None,
        )
    for x, answer in zip(inputs, held, strict=True):
        assert_matches_reference("mlp", x, answer.result())
