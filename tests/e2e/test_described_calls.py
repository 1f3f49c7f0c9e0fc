"""`--frontends 2`: ModelInfer calls on served versions go to the parent as descriptors the
front-end decoded and validated, counted in paddlequic_frontend_described_calls_total (with
`--no-frontend-queues`, or for a version whose requests the front-ends do not queue
themselves); with front-end queues (the default) the front-end serves them itself, and the
parent takes no part. Either way the answers and what is counted are the single process's. Their
answers are the model's; the calls the front-end does not describe (bad requests, shared
memory, unknown models) are answered exactly as a single process answers them (code and
message), and every call is counted once in the request metrics. A reload or an unload while
calls run leaves no call answered by a version it was not validated for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request
from clients.quic_channel import QuicChannel
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1 import control_pb2
from service.inference.validation import INLINE_DECODE_ELEMENTS
from tests.e2e import test_lifecycle as lifecycle
from tests.reference import assert_matches_reference, call_inputs, output_names
from tests.servers import (
    ServerProcess,
    eventually,
    held_still,
    model_repository,
    paused,
    running_server,
    wait_arrived,
    wait_logged,
)

pytestmark = pytest.mark.e2e

KEY = "described-test-key"
HEADER = (("triton-grpc-protocol-infer-key", KEY),)
RESTRICTED = ["--restricted-protocol", f"inference:infer-key={KEY}"]
CALLS = 12
MAX_MESSAGE = 1 << 20
FRAME_OVERHEAD = 1 << 20  # service/frontends/link.py
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[dict[str, ServerProcess]]:
    """A single process, one with two front-ends passing calls on as descriptors, and one
    whose front-ends serve them, all restricting inference."""
    root = tmp_path_factory.mktemp("described")
    repository = model_repository(root / "models", ["mlp", "text_classifier"])
    args = ["--certs-dir", str(certs_dir), "--max-message-bytes", str(MAX_MESSAGE), *RESTRICTED]
    two = [*args, "--frontends", "2"]
    with (
        running_server(repository, root / "one.log", [*args, "--frontends", "1"]) as one,
        running_server(repository, root / "two.log", [*two, "--no-frontend-queues"]) as two_d,
        running_server(repository, root / "served.log", two) as served,
    ):
        yield {"one": one, "described": two_d, "served": served}


def counter(server: ServerProcess, name: str, **labels: str) -> float:
    """The sum of a counter's samples whose labels include `labels`."""
    return sum(
        sample.value
        for sample in server.metrics()
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def described(server: ServerProcess, transport: str) -> float:
    return counter(server, "paddlequic_frontend_described_calls_total", transport=transport)


def answered(server: ServerProcess, transport: str, code: str) -> float:
    return counter(
        server, "paddlequic_requests_total", rpc="ModelInfer", transport=transport, code=code
    )


def timed_out(server: ServerProcess) -> float:
    """HTTP/2 ModelInfer calls whose client's deadline passed (see the test below)."""
    return answered(server, "h2", "DEADLINE_EXCEEDED") + answered(server, "h2", "CANCELLED")


def passed_on(server: ServerProcess) -> float:
    """Calls the front-ends passed on to the parent (as descriptors or bytes)."""
    return counter(server, "paddlequic_frontend_calls_total")


def calls(server: ServerProcess) -> float:
    """ModelInfer calls over HTTP/2 the server finished, whatever their status."""
    return counter(server, "paddlequic_requests_total", rpc="ModelInfer", transport="h2")


async def infer_calls(
    stub: Any, server_calls: range, metadata: tuple[tuple[str, str], ...] = HEADER
) -> None:
    """Calls with inputs of their own, concurrently; each answer checked against Paddle's."""

    async def one(call: int) -> None:
        inputs = call_inputs("mlp", call)
        request = build_request("mlp", inputs, request_id=f"call-{call}")
        response = await stub.ModelInfer(request, timeout=30, metadata=metadata)
        assert response.id == f"call-{call}"
        assert (response.model_name, response.model_version) == ("mlp", "1")
        assert_matches_reference("mlp", inputs, response)

    await asyncio.gather(*(one(call) for call in server_calls))


@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_model_infer_goes_as_a_descriptor_and_is_counted_once(
    servers: dict[str, ServerProcess], certs_dir: Path, transport: str
) -> None:
    server = servers["described"]
    before = (described(server, transport), answered(server, transport, "OK"))
    await infer_over(server, certs_dir, transport)
    after = (described(server, transport), answered(server, transport, "OK"))
    assert (after[0] - before[0], after[1] - before[1]) == (CALLS, CALLS)


@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_model_infer_is_served_by_the_front_end_and_counted_once(
    servers: dict[str, ServerProcess], certs_dir: Path, transport: str
) -> None:
    """With front-end queues nothing of the call reaches the parent: no call passed on, none
    described; it is counted once where the parent sums the front-ends' counts."""
    server = servers["served"]

    def counts() -> tuple[float, ...]:
        here = counter(server, "paddlequic_frontend_served_calls_total", transport=transport)
        return (
            passed_on(server),
            described(server, transport),
            answered(server, transport, "OK"),
            here,
        )

    before = counts()
    await infer_over(server, certs_dir, transport)
    assert [a - b for a, b in zip(counts(), before, strict=True)] == [0, 0, CALLS, CALLS]


async def infer_over(server: ServerProcess, certs_dir: Path, transport: str) -> None:
    if transport == "h2":
        async with grpc.aio.insecure_channel(server.address) as channel:
            await infer_calls(pb_grpc.GRPCInferenceServiceStub(channel), range(CALLS))
    else:
        quic = QuicChannel(f"localhost:{server.port}", ca_file=str(certs_dir / "ca.pem"))
        try:
            await infer_calls(pb_grpc.GRPCInferenceServiceStub(quic), range(CALLS))
        finally:
            await quic.close()


def _good() -> pb.ModelInferRequest:
    return build_request("mlp", {"input": np.ones((2, 256), np.float32)})


def _classes(request: pb.ModelInferRequest, **parameter: Any) -> None:
    """The request asks for its output's top classes (the classification extension)."""
    output = request.outputs.add(name=output_names("mlp")[0])
    output.parameters["classification"].CopyFrom(pb.InferParameter(**parameter))


def _edited(edit: Callable[[pb.ModelInferRequest], object]) -> bytes:
    request = _good()
    edit(request)
    return request.SerializeToString()


BAD_REQUESTS: dict[str, bytes] = {
    "unknown model": _edited(lambda r: setattr(r, "model_name", "nope")),
    "version not served": _edited(lambda r: setattr(r, "model_version", "7")),
    "wrong datatype": _edited(lambda r: setattr(r.inputs[0], "datatype", "FP64")),
    "wrong rank": _edited(lambda r: r.inputs[0].shape.append(1)),
    "short contents": _edited(lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 12)),
    "unknown input": _edited(lambda r: setattr(r.inputs[0], "name", "other")),
    "unknown output": _edited(lambda r: r.outputs.add(name="nothing")),
    "bad priority": _edited(lambda r: r.parameters["priority"].__setattr__("string_param", "x")),
    "unregistered region": _edited(
        lambda r: r.inputs[0].parameters["shared_memory_region"].__setattr__("string_param", "x")
    ),
    "not protobuf": b"\xff\xff\xff",
    "too many outputs": _edited(lambda r: [r.outputs.add(name="o") for _ in range(1100)]),
    "classification of 0 classes": _edited(lambda r: _classes(r, int64_param=0)),
    "classification not an int64": _edited(lambda r: _classes(r, string_param="3")),
}


def _status(server: ServerProcess, message: bytes, metadata: Any = HEADER) -> tuple[str, str]:
    call = server.channel.unary_unary(MODEL_INFER, None, None)
    with pytest.raises(grpc.RpcError) as caught:
        call(message, timeout=30, metadata=metadata)
    error: Any = caught.value
    return error.code().name, error.details()


# Refused by the version's validator, which the front-end has too: it answers them itself and
# the parent only records them (REFUSED). The others go on as bytes, answered by the parent.
ANSWERED_BY_FRONTENDS = frozenset(
    {
        "wrong datatype",
        "wrong rank",
        "short contents",
        "unknown input",
        "unknown output",
        "bad priority",
    }
)


def failures(server: ServerProcess) -> int:
    """The failed inferences ModelStatistics counts against mlp's version."""
    request = pb.ModelStatisticsRequest(name="mlp", version="1")
    (stats,) = server.stub.ModelStatistics(request, timeout=30).model_stats
    return int(stats.inference_stats.fail.count)


@pytest.mark.parametrize("bad", sorted(BAD_REQUESTS))
def test_refusals_are_the_single_process_ones(servers: dict[str, ServerProcess], bad: str) -> None:
    """Same code, same message, counted once (metrics and the version's statistics), whether
    the front-end refused the call itself or passed it on as bytes for the parent to."""
    before = {n: (calls(s), described(s, "h2"), failures(s)) for n, s in servers.items()}
    statuses = {n: _status(s, BAD_REQUESTS[bad]) for n, s in servers.items()}
    assert len(set(statuses.values())) == 1
    assert statuses["one"][0] != "OK"
    counted = int(bad in ANSWERED_BY_FRONTENDS)  # a version's failure, as on one process
    # A refusal a front-end makes it reports to the parent (REFUSED), serving or describing.
    two = (1, counted, counted)
    expected = {"one": (1, 0, counted), "described": two, "served": two}

    def deltas() -> dict[str, tuple[float, ...]]:
        after = {n: (calls(s), described(s, "h2"), failures(s)) for n, s in servers.items()}
        return {n: tuple(a - b for a, b in zip(after[n], before[n], strict=True)) for n in servers}

    # A call is recorded as its status goes out: the client can read the metrics first. The
    # counts must come to exactly these (a call counted twice never does).
    eventually(lambda: deltas() == expected, f"the counts {expected}")


def test_restricted_inference_without_the_header_is_refused_alike(
    servers: dict[str, ServerProcess],
) -> None:
    message = _good().SerializeToString()
    before = described(servers["described"], "h2"), passed_on(servers["served"])
    statuses = {n: _status(s, message, metadata=()) for n, s in servers.items()}
    assert len(set(statuses.values())) == 1
    assert statuses["one"][0] == "UNAUTHENTICATED"
    assert described(servers["described"], "h2") - before[0] == 1  # refused by the parent
    assert passed_on(servers["served"]) == before[1]  # refused by the front-end serving it
    # A request its validator refuses, without the header: not the front-end's to answer
    # (the header is checked first), so it goes on as bytes and the parent says why.
    bad = BAD_REQUESTS["wrong datatype"]
    statuses = {n: _status(s, bad, metadata=()) for n, s in servers.items()}
    assert len(set(statuses.values())) == 1
    assert statuses["one"][0] == "UNAUTHENTICATED"
    assert described(servers["described"], "h2") - before[0] == 1


def _direct_once(server: ServerProcess, served: bool) -> bool:
    """Whether one call now goes as a descriptor (the front-end's view holds the version) or,
    `served`, the front-end serves it with no part for the parent."""

    def count() -> float:
        return passed_on(server) if served else described(server, "h2")

    before = count()
    server.stub.ModelInfer(lifecycle.REQUEST, timeout=30)
    return count() - before == (0 if served else 1)


@pytest.mark.parametrize("served", [False, True], ids=["described", "served"])
def test_reload_and_unload_while_calls_run(tmp_path: Path, served: bool) -> None:
    """A reload under load fails no call and mixes no versions; the front-ends then describe
    (or serve) calls on the new version; after an unload a call gets the single process's
    error."""
    repo = lifecycle.repository(tmp_path / "models")
    args = ["--model-control-mode", "explicit", "--load-model", "mlp", "--no-h3"]
    args += ["--frontends", "2", "--frontend-queues" if served else "--no-frontend-queues"]
    with running_server(repo, tmp_path / "log", args) as server:
        eventually(lambda: _direct_once(server, served), "a described call")
        with lifecycle.Load(server) as load:
            lifecycle.publish(repo, 2)
            server.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mlp"))
            swapped_at = len(load.answers)
            eventually(
                lambda: len(load.answers) > swapped_at + 4 * lifecycle.CLIENTS, "answers after swap"
            )
        assert load.failures == []
        outputs = {v: {out for version, out in load.answers if version == v} for v in "12"}
        assert len(outputs["1"]) == 1 and len(outputs["2"]) == 1  # each from one version
        assert all(v == "2" for v, _ in load.answers[swapped_at + 2 * lifecycle.CLIENTS :])
        # Version 1 stops once every front-end let it go, not at its wind-down timeout (60 s:
        # a front-end's report from under load was waited for after its release).
        wait_logged(server, "model mlp version 1 replaced; its workers stopped", limit_s=30)
        eventually(lambda: _direct_once(server, served), "a described call on version 2")

        server.stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="mlp"))
        before = calls(server)
        for version in ("", "2"):
            request = build_request(
                "mlp", {"input": np.ones((1, 256), np.float32)}, version=version
            )
            assert _status(server, request.SerializeToString(), metadata=()) == (
                "UNAVAILABLE",
                "model 'mlp' was unloaded; load it again with RepositoryModelLoad",
            )
        assert calls(server) - before == 2

        server.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mlp"))
        eventually(lambda: _direct_once(server, served), "a described call after loading")


def _typed_contents(request: pb.ModelInferRequest) -> None:
    request.ClearField("raw_input_contents")
    request.inputs[0].contents.fp32_contents.extend([0.5] * 512)


UNUSUAL_REQUESTS: dict[str, bytes] = {
    "id past a descriptor's text": _edited(lambda r: setattr(r, "id", "i" * 70_000)),
    "priority past 63 bits": _edited(
        lambda r: r.parameters["priority"].__setattr__("uint64_param", 2**64 - 1)
    ),
    "typed contents": _edited(_typed_contents),
    # Ranked by whoever runs the call: the single process, the parent for a descriptor that
    # carries the classes, the front-end serving it.
    "classes": _edited(lambda r: _classes(r, int64_param=3)),
}


def _outcome(server: ServerProcess, message: bytes) -> tuple[str, str]:
    call = server.channel.unary_unary(MODEL_INFER, None, None)
    try:
        answer = pb.ModelInferResponse.FromString(call(message, timeout=30, metadata=HEADER))
    except grpc.RpcError as exc:
        error: Any = exc
        return error.code().name, error.details()
    return "OK", f"{answer.id[:20]} {len(answer.id)} {answer.raw_output_contents[0].hex()}"


@pytest.mark.parametrize("unusual", sorted(UNUSUAL_REQUESTS))
def test_unusual_requests_get_the_single_process_answer(
    servers: dict[str, ServerProcess], unusual: str
) -> None:
    outcomes = {n: _outcome(s, UNUSUAL_REQUESTS[unusual]) for n, s in servers.items()}
    assert len(set(outcomes.values())) == 1


def test_a_request_asking_for_classes_goes_as_a_descriptor(
    servers: dict[str, ServerProcess],
) -> None:
    """The descriptor carries the outputs to rank and their k: the parent ranks them (the
    single process's answer, above), the call described, not passed on as bytes."""
    server = servers["described"]
    before = described(server, "h2")
    assert _outcome(server, UNUSUAL_REQUESTS["classes"])[0] == "OK"
    eventually(lambda: described(server, "h2") == before + 1, "the call counted as described")


def test_a_descriptor_larger_than_its_message_goes_as_bytes(
    servers: dict[str, ServerProcess],
) -> None:
    """Typed INT64 zeros take 1 byte each in the message and 8 as raw bytes: a descriptor past
    the dispatch frame limit would break the front-end's link; it goes as the message."""
    tokens = 300_000
    request = pb.ModelInferRequest(model_name="text_classifier")
    tensor = request.inputs.add(name="token_ids", datatype="INT64", shape=[1, tokens])
    tensor.contents.int64_contents.extend([0] * tokens)
    message = request.SerializeToString()
    assert len(message) < MAX_MESSAGE and tokens * 8 > MAX_MESSAGE + FRAME_OVERHEAD
    before = described(servers["described"], "h2")
    outcomes = {n: _outcome(s, message) for n, s in servers.items()}
    assert len(set(outcomes.values())) == 1
    assert described(servers["described"], "h2") == before
    for two in ("described", "served"):
        assert counter(servers[two], "paddlequic_frontend_restarts_total") == 0


def test_typed_contents_past_the_inline_decode_bound_are_described(
    servers: dict[str, ServerProcess],
) -> None:
    """More typed values than a single process converts on its event loop: the front-end
    converts them, the parent gets raw bytes; the same answer as a single process."""
    rows = 32  # text_classifier's max_batch_size; its cost grows with the square of a row
    tokens = INLINE_DECODE_ELEMENTS // rows + 8
    request = pb.ModelInferRequest(model_name="text_classifier", id="big")
    tensor = request.inputs.add(name="token_ids", datatype="INT64", shape=[rows, tokens])
    tensor.contents.int64_contents.extend(i % 1000 for i in range(rows * tokens))
    message = request.SerializeToString()
    before = described(servers["described"], "h2")
    outcomes = {n: _outcome(s, message) for n, s in servers.items()}
    assert len(set(outcomes.values())) == 1 and outcomes["one"][0] == "OK"
    assert described(servers["described"], "h2") == before + 1


@pytest.mark.parametrize("path", ["one", "described", "served"])
async def test_a_described_call_past_its_deadline_ends_everywhere(
    servers: dict[str, ServerProcess], path: str
) -> None:
    """The worker held still: the call ends DEADLINE_EXCEEDED, as on a single process, it is
    counted once, and nothing stays in flight in the parent once the worker goes on. The
    client's deadline passes first (its clock started before the request reached the
    server), and its cancel counts as the deadline when it comes within the margin of the
    server's own (`deadline_passed`, swept in tests/unit); on a host loaded enough that the
    request's headers waited longer than that to be read, it is counted CANCELLED: either
    way, once."""
    server = servers[path]
    (instance,) = server.instances("mlp")
    before = (described(server, "h2"), timed_out(server))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        counted = lambda: timed_out(server) > before[1]  # noqa: E731
        with paused(instance.pid):
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await stub.ModelInfer(_good(), timeout=1.0, metadata=HEADER)
            # Ended by the server's own timer while the worker is still held: resumed at
            # once, its answer could beat the client's cancel to a loaded server (then OK).
            await asyncio.to_thread(eventually, counted, "the late call counted")
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await infer_calls(stub, range(CALLS, CALLS + 2))  # the worker answers again
    after = (described(server, "h2"), timed_out(server))
    assert (after[0] - before[0], after[1] - before[1]) == ((path == "described") * 3, 1)
    assert counter(server, "paddlequic_inflight_requests", transport="h2") == 0


def _held(server: ServerProcess) -> float:
    """Requests for mlp the server holds: queued, or in batches given to its worker."""
    request = control_pb2.ListInstancesRequest(model_name="mlp")
    queues = server.control.ListInstances(request, timeout=5).queues
    return float(sum(q.queued + q.in_flight for q in queues))


@pytest.mark.parametrize("path", ["one", "described", "served"])
async def test_described_calls_whose_clients_go_leave_the_server(
    servers: dict[str, ServerProcess], path: str
) -> None:
    """Two calls held by a stopped worker (one given to it, one queued), then cancelled by
    their client: the server lets both go before the worker moves (the queued one leaves the
    queue), each is counted once as CANCELLED, as on a single process, and nothing stays in
    flight."""
    server = servers[path]
    (instance,) = server.instances("mlp")
    before = answered(server, "h2", "CANCELLED")
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with paused(instance.pid):
            held = [
                asyncio.ensure_future(stub.ModelInfer(_good(), metadata=HEADER)) for _ in range(2)
            ]
            await asyncio.to_thread(wait_arrived, server, "mlp", 2)
            for call in held:
                call.cancel()
            assert await held_still(lambda: _held(server), looks=5, limit_s=60) == 0
        await infer_calls(stub, range(CALLS + 2, CALLS + 4))  # the worker answers again
    assert answered(server, "h2", "CANCELLED") - before == 2
    assert counter(server, "paddlequic_inflight_requests", transport="h2") == 0
