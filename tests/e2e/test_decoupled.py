"""Decoupled models (Triton's `model_transaction_policy { decoupled: true }`) on a real server,
over both transports with the generated stubs: a Triton-style `repeat` model.py
(tests/fixtures/decoupled_model) answers each request with many responses from a thread.

Nothing here waits on the clock to decide: a model that stopped is recognised by its
generated-tokens counter holding still for QUIET_LOOKS looks in a row (each a scrape), and
the worker is held still with SIGSTOP where a request must not have started yet."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1 import control_pb2
from service.api.stream_inference import STREAM_WINDOW
from service.workers.protocol import RESPONSE_WINDOW
from tests.conformance.conftest import EOF, Channel, eventually, new_channel
from tests.servers import EXAMPLE_MODELS, ServerProcess, held_still, paused, running_server

pytestmark = pytest.mark.e2e

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "decoupled_model"
MODEL = "repeat"
TRANSPORTS = ("h2", "h3")
CALL_TIMEOUT_S = 120.0  # generous: only a broken server reaches it
QUIET_LOOKS = 25  # scrapes in a row that saw the counter hold still
FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
CONCURRENT, QUEUED = 4, 2  # the fixture's max_concurrent_requests, max_queued_requests


def decoupled_repository(target: Path) -> Path:
    (target / MODEL / "1").mkdir(parents=True)
    shutil.copy(FIXTURE / "config.pbtxt", target / MODEL / "config.pbtxt")
    shutil.copy(FIXTURE / "model.py", target / MODEL / "1" / "model.py")
    return target


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("decoupled")
    args = ["--certs-dir", str(certs_dir), "--trace-console"]
    with running_server(decoupled_repository(root / "models"), root / "server.log", args) as s:
        yield s


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def channel_to(server: ServerProcess, transport: str, certs_dir: Path) -> Channel:
    return new_channel(transport, server, certs_dir / "ca.pem")


def repeat(
    count: int,
    request_id: str,
    *,
    delay_ms: int = 0,
    size: int = 1,
    mode: str = "",
    empty_final: bool | None = None,
) -> pb.ModelInferRequest:
    inputs = {
        "count": np.array([count], np.int32),
        "delay_ms": np.array([delay_ms], np.int32),
        "size": np.array([size], np.int32),
        "mode": np.array([mode.encode()], np.object_),
    }
    request = build_request(MODEL, inputs, request_id=request_id)
    if empty_final is not None:
        request.parameters[EMPTY_FINAL].bool_param = empty_final
    return request


def final_flag(response: pb.ModelStreamInferResponse) -> bool | None:
    parameters = response.infer_response.parameters
    return parameters[FINAL].bool_param if FINAL in parameters else None


def index_of(response: pb.ModelStreamInferResponse) -> int:
    return int(parse_response(response.infer_response)["index"][0])


async def read_all(call: Any) -> list[pb.ModelStreamInferResponse]:
    responses = []
    while (response := await call.read()) is not EOF:
        responses.append(response)
    return responses


async def until_id(call: Any, request_id: str) -> list[pb.ModelStreamInferResponse]:
    """Responses until (and with) the next one for `request_id`."""
    seen = []
    while True:
        response = await call.read()
        assert response is not EOF, f"the stream ended before a response for {request_id}"
        seen.append(response)
        if response.infer_response.id == request_id:
            return seen


def scrape(server: ServerProcess) -> dict[tuple[str, str], float]:
    """The decoupled metrics of MODEL by (sample name, `le` or "")."""
    url = re.search(r"metrics on (http://\S+/metrics)", server.log_text())
    assert url is not None
    with urllib.request.urlopen(url.group(1), timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, s.labels.get("le", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("model") == MODEL
    }


def generated(server: ServerProcess) -> float:
    return scrape(server).get(("paddlequic_generated_tokens_total", ""), 0.0)


async def quiet_count(server: ServerProcess) -> float:
    """The generated-tokens counter once it held still for QUIET_LOOKS scrapes in a row."""
    return await held_still(lambda: generated(server), QUIET_LOOKS, CALL_TIMEOUT_S)


def worker_pid(server: ServerProcess) -> int:
    (instance,) = server.instances(MODEL)
    return int(instance.pid)


async def wait_state(server: ServerProcess, pid: int) -> None:
    """Until the worker that replaced `pid` is READY."""

    async def restarted() -> bool:
        (instance,) = await asyncio.to_thread(server.instances, MODEL)
        return bool(instance.pid != pid and instance.state == "READY")

    await eventually(restarted, "the killed worker restarted", attempts=3000)


async def queue_of(server: ServerProcess) -> tuple[int, int]:
    """(waiting, running) requests of MODEL."""
    request = control_pb2.ListInstancesRequest(model_name=MODEL)
    listed = await asyncio.to_thread(server.control.ListInstances, request, timeout=10)
    (queue,) = listed.queues
    return queue.queued, queue.in_flight


# ---- what a request's responses look like ----


# Around the worker's window: more responses than it may have untaken need the server's credits.
@pytest.mark.parametrize("count", [1, RESPONSE_WINDOW, RESPONSE_WINDOW + 1, 3 * RESPONSE_WINDOW])
async def test_n_responses_carry_the_id_and_the_final_flag_on_the_last(
    server: ServerProcess, transport: str, certs_dir: Path, count: int
) -> None:
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(repeat(count, "r-1", size=3))
        await call.done_writing()
        responses = await read_all(call)
        assert await call.code() is grpc.StatusCode.OK
    assert [r.error_message for r in responses] == [""] * count
    assert {r.infer_response.id for r in responses} == {"r-1"}
    assert [index_of(r) for r in responses] == list(range(count))
    assert [final_flag(r) for r in responses] == [False] * (count - 1) + [True]
    data = parse_response(responses[-1].infer_response)["data"]
    assert data.tolist() == [count - 1] * 3 and data.dtype == np.uint8


@pytest.mark.parametrize("asked", [True, False, None])
async def test_empty_final_response_only_when_the_request_asks(
    server: ServerProcess, transport: str, certs_dir: Path, asked: bool | None
) -> None:
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(repeat(3, "flags", mode="flags_final", empty_final=asked))
        # Its last data response is final: never followed by an empty one.
        await call.write(repeat(2, "plain", empty_final=asked))
        await call.done_writing()
        responses = await read_all(call)
        assert await call.code() is grpc.StatusCode.OK
    flags = [r for r in responses if r.infer_response.id == "flags"]
    plain = [r for r in responses if r.infer_response.id == "plain"]
    assert [final_flag(r) for r in plain] == [False, True]
    if asked:
        assert [final_flag(r) for r in flags] == [False, False, False, True]
        empty = flags[-1].infer_response
        assert (len(empty.outputs), empty.model_name, empty.id) == (0, MODEL, "flags")
    else:
        assert [final_flag(r) for r in flags] == [False, False, False]


async def test_an_optional_input_may_be_left_out_and_a_required_one_not(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    without_size = repeat(2, "optional")
    del without_size.inputs[2]
    del without_size.raw_input_contents[2]
    without_count = repeat(2, "required")
    del without_count.inputs[0]
    del without_count.raw_input_contents[0]
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(without_size)
        await call.write(without_count)
        await call.done_writing()
        responses = await read_all(call)
    answered = [r for r in responses if r.infer_response.id == "optional"]
    assert [parse_response(r.infer_response)["data"].tolist() for r in answered] == [[0], [1]]
    (refused,) = [r for r in responses if r.infer_response.id == "required"]
    assert refused.error_message.startswith("INVALID_ARGUMENT")
    assert "missing input(s) ['count']" in refused.error_message


async def test_the_model_sees_the_requests_id_and_parameters(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    request_id = f"parameters-{transport}"
    request = repeat(1, request_id, mode="parameters")
    request.parameters["label"].string_param = "café"
    request.parameters["n"].int64_param = 3
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(request)
        await call.done_writing()
        assert len(await read_all(call)) == 1
    prefix = f"model {MODEL}: request {request_id} parameters "

    def printed() -> list[str]:
        """The model's print, which reaches the server's log through its worker's output pipe:
        it may come after the response."""
        messages = [o.get("message", "") for o in server.log_objects()]
        return [m.removeprefix(prefix) for m in messages if m.startswith(prefix)]

    async def logged() -> bool:
        return bool(printed())

    await eventually(logged, "the model's print in the log", 600, 0.1)
    (line,) = printed()
    assert json.loads(line) == {"label": "café", "n": 3}


async def test_two_requests_interleave_on_one_stream(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(repeat(0, "long", mode="forever", delay_ms=20))
        await until_id(call, "long")
        await call.write(repeat(2, "short"))
        seen = [r.infer_response.id for r in await until_id(call, "short")]
        seen += [r.infer_response.id for r in await until_id(call, "short")]
        seen += [r.infer_response.id for r in await until_id(call, "long")]
        call.cancel()
    # "long" answered on both sides of "short", which ended while "long" went on.
    assert seen[-1] == "long" and seen.count("short") == 2


async def test_an_error_is_that_requests_error_message_and_the_stream_goes_on(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(repeat(1, "bad", mode="error"))
        bad = await until_id(call, "bad")
        await call.write(repeat(2, "good"))
        await call.done_writing()
        rest = await read_all(call)
        assert await call.code() is grpc.StatusCode.OK
    (error,) = [r for r in bad if r.infer_response.id == "bad"]
    assert "request bad refused on purpose" in error.error_message
    assert (error.infer_response.model_name, final_flag(error)) == (MODEL, True)
    assert [index_of(r) for r in rest] == [0, 1]


async def test_model_infer_on_a_decoupled_model_names_model_stream_infer(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    async with channel_to(server, transport, certs_dir) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            await stub.ModelInfer(repeat(1, "unary"), timeout=CALL_TIMEOUT_S)
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "ModelStreamInfer" in (refused.value.details() or "")


# ---- cancellation, deadlines, back-pressure: they reach the model ----


async def test_cancelling_the_call_stops_the_model(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    await assert_cancel_stops(server, transport, certs_dir)


async def assert_cancel_stops(server: ServerProcess, transport: str, certs_dir: Path) -> None:
    request_id = f"cancel-{transport}"
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(repeat(0, request_id, mode="forever", delay_ms=5))
        for _ in range(3):
            await until_id(call, request_id)
        call.cancel()
    stopped = await quiet_count(server)
    assert f"request {request_id} cancelled after" in server.log_text()
    assert generated(server) == stopped


async def test_a_passed_deadline_ends_the_call_and_cancels_the_request_in_the_model(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    request_id = f"deadline-{transport}"
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=3)
        await call.write(repeat(0, request_id, mode="forever", delay_ms=5))
        with contextlib.suppress(grpc.RpcError):
            while (response := await call.read()) is not EOF:
                if response.error_message:
                    assert response.error_message.startswith("DEADLINE_EXCEEDED")
                    break
        assert await call.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await quiet_count(server)
    assert f"request {request_id} cancelled after" in server.log_text()


async def test_a_model_silent_past_execution_timeout_fails_its_request_and_is_cancelled(
    server: ServerProcess, certs_dir: Path
) -> None:
    """Below the transports (one is enough): the gap is bounded in the worker's handle."""
    transport = "h2"
    request_id = f"silent-{transport}"
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(repeat(0, request_id, mode="silent"))
        (error,) = await until_id(call, request_id)
        await call.done_writing()
        assert await read_all(call) == []
    assert error.error_message.startswith("INTERNAL")
    assert "execution_timeout_ms" in error.error_message and final_flag(error) is True

    async def cancelled() -> bool:
        return f"request {request_id} cancelled after 0" in server.log_text()

    await eventually(cancelled, "the silent request was cancelled in the model")


async def test_a_client_that_stops_reading_holds_its_model_and_others_are_served(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    size = 64 << 10  # per response: what the transports buffer holds few of them
    before = await quiet_count(server)
    rss_before = rss(server.process.pid)
    async with channel_to(server, transport, certs_dir) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stalled = stub.ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await stalled.write(repeat(0, "stalled", mode="forever", size=size))
        await until_id(stalled, "stalled")  # then it reads no more
        held = await quiet_count(server) - before
        async with channel_to(server, transport, certs_dir) as other:
            served = pb_grpc.GRPCInferenceServiceStub(other).ModelStreamInfer(
                timeout=CALL_TIMEOUT_S
            )
            await served.write(repeat(3, "other"))
            await served.done_writing()
            assert [index_of(r) for r in await read_all(served)] == [0, 1, 2]
        # The stalled stream's responses, the other's 3 taken out. A loaded machine can pause
        # the stalled stream's production for longer than quiet_count looks (seen once: 64
        # more, its queue's worth, came after it), so it may have gone on since, never past
        # what its windows hold.
        stalled_total = await quiet_count(server) - before - 3
        stalled.cancel()
    # Held by the windows: the worker's (RESPONSE_WINDOW), the stream's queue, the transports'.
    assert 0 < held <= stalled_total < held_bound(size)
    assert rss(server.process.pid) - rss_before < stalled_total * size + RSS_SLACK


# What the transports buffer of a stream nobody reads (observed: about 100 responses of 64 KiB
# beyond the server's windows on HTTP/2, about 35 on HTTP/3).
TRANSPORT_BUFFER = 16 << 20
RSS_SLACK = 64 << 20


def held_bound(size: int) -> int:
    """Responses generated for a reader that stopped: the worker's window, the stream's
    response queue, then what the transports buffer."""
    return RESPONSE_WINDOW + STREAM_WINDOW + 1 + TRANSPORT_BUFFER // size


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


async def test_each_request_gets_a_span_with_its_response_count(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    request_id = f"span-{transport}"
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(repeat(4, request_id))
        await call.write(repeat(2, f"{request_id}-other"))
        await call.done_writing()
        assert len(await read_all(call)) == 6

    def spans() -> list[dict[str, Any]]:
        return server.log_objects()

    def generate_span() -> dict[str, Any] | None:
        return next(
            (
                s
                for s in spans()
                if s.get("name") == "generate"
                and s["attributes"].get("paddlequic.request_id") == request_id
            ),
            None,
        )

    async def written() -> bool:
        return generate_span() is not None

    await eventually(written, "the request's span was written")
    span = generate_span()
    assert span is not None and span["attributes"]["paddlequic.responses"] == 4
    (parent,) = [s for s in spans() if s.get("context", {}).get("span_id") == span["parent_id"]]
    assert parent["attributes"]["rpc.method"] == "ModelStreamInfer"


# ---- the worker dies ----


async def test_a_request_without_responses_runs_again_when_its_worker_dies(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    pid = worker_pid(server)
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        with paused(pid):  # it cannot answer before it is killed
            await call.write(repeat(2, "again"))

            async def held() -> bool:
                return (await queue_of(server))[1] == 1

            await eventually(held, "the request reached the worker")
            os.kill(pid, signal.SIGKILL)
        await call.done_writing()
        responses = await read_all(call)
        assert await call.code() is grpc.StatusCode.OK
    assert [(r.error_message, index_of(r)) for r in responses] == [("", 0), ("", 1)]
    await wait_state(server, pid)


async def test_a_request_with_responses_fails_unavailable_with_their_count(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    pid = worker_pid(server)
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(repeat(0, "lost", mode="forever", delay_ms=5))
        for _ in range(3):
            await until_id(call, "lost")
        os.kill(pid, signal.SIGKILL)
        await call.done_writing()
        rest = await read_all(call)
        assert await call.code() is grpc.StatusCode.OK
    *data, error = rest
    assert all(not r.error_message for r in data)
    assert error.error_message.startswith("UNAVAILABLE")
    assert f"after {3 + len(data)} response(s) were delivered" in error.error_message
    assert final_flag(error) is True
    await wait_state(server, pid)
    # It was serving when it died: it came back at once, not after a crash loop's back-off.
    # With front-ends (PADDLEQUIC_FRONTENDS) the parent counts the requests in it as the
    # front-ends last reported them, which may be before this one came.
    held = "1" if os.environ.get("PADDLEQUIC_FRONTENDS", "1") == "1" else r"\d+"
    death = rf"\(pid {pid}\) was killed by signal 9; {held} request\(s\) in it go back to the queue"
    assert re.search(death + r"; restarting in 0\.0 s", server.log_text())


async def test_a_request_that_kills_its_worker_twice_is_refused_as_poison(
    server: ServerProcess, certs_dir: Path
) -> None:
    """Below the transports (one is enough): the retry is the streaming path's."""
    pid = worker_pid(server)
    async with channel_to(server, "h2", certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(repeat(1, "poison", mode="crash"))
        (error,) = await until_id(call, "poison")
        await call.done_writing()
        assert await read_all(call) == []
    assert error.error_message.startswith("INTERNAL: suspected poison input")
    assert "died 2 times" in error.error_message and final_flag(error) is True
    await wait_state(server, pid)


# ---- the version's places ----


async def test_beyond_the_concurrency_bound_requests_wait_then_are_refused(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    async with channel_to(server, transport, certs_dir) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        running = [stub.ModelStreamInfer(timeout=CALL_TIMEOUT_S) for _ in range(CONCURRENT)]
        for n, call in enumerate(running):
            await call.write(repeat(0, f"run-{n}", mode="forever", delay_ms=20))
            await until_id(call, f"run-{n}")
        waiting = [stub.ModelStreamInfer(timeout=CALL_TIMEOUT_S) for _ in range(QUEUED)]
        for n, call in enumerate(waiting):
            await call.write(repeat(1, f"wait-{n}"))

        seen: list[tuple[int, int]] = []  # ListInstances' (waiting, running), as last read

        async def queued(count: int) -> bool:
            seen[:] = [await queue_of(server)]
            return seen[0] == (count, CONCURRENT)

        try:
            await eventually(lambda: queued(QUEUED), "the waiters queued")
        except AssertionError as exc:  # what was counted instead, for the failure's reader
            raise AssertionError(
                f"{exc}; ListInstances last read (waiting, running) {seen}"
            ) from None
        refused = stub.ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await refused.write(repeat(1, "refused"))
        (error,) = await until_id(refused, "refused")
        assert error.error_message.startswith("RESOURCE_EXHAUSTED")
        assert "max_concurrent_requests" in error.error_message
        assert f"at most {CONCURRENT} requests at once" in error.error_message
        # A waiter whose caller goes away leaves the line at once (the running ones still run).
        waiting[0].cancel()
        await eventually(lambda: queued(QUEUED - 1), "the cancelled waiter left the line")
        for call in running:
            call.cancel()
        (answer,) = await until_id(waiting[1], "wait-1")
        assert index_of(answer) == 0
        for call in (*waiting, refused):
            call.cancel()

        async def idle() -> bool:
            return (await queue_of(server)) == (0, 0)

        await eventually(idle, "every place freed")


# ---- metrics ----


async def test_metrics_count_responses_exactly(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    await assert_counted(server, transport, certs_dir)


async def assert_counted(server: ServerProcess, transport: str, certs_dir: Path) -> None:
    """One request of 6 responses: 6 tokens, one first-token time, 5 gaps, none active."""
    await quiet_count(server)
    before, counted = scrape(server), statistics(server)
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(repeat(6, "counted"))
        await call.done_writing()
        assert len(await read_all(call)) == 6
    after = scrape(server)

    def grew(name: str) -> float:
        return after.get((name, ""), 0.0) - before.get((name, ""), 0.0)

    assert grew("paddlequic_generated_tokens_total") == 6
    assert grew("paddlequic_time_to_first_token_seconds_count") == 1
    assert grew("paddlequic_inter_token_seconds_count") == 5
    assert after[("paddlequic_active_generations", "")] == 0
    assert statistics(server) == (counted[0] + 1, counted[1])  # one success, no failure


def statistics(server: ServerProcess) -> tuple[int, int]:
    """MODEL's (successful, failed) requests in ModelStatistics."""
    stats = server.stub.ModelStatistics(pb.ModelStatisticsRequest(name=MODEL), timeout=10)
    inference = stats.model_stats[0].inference_stats
    return inference.success.count, inference.fail.count


@pytest.fixture(scope="module")
def two_frontends(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("decoupled_frontends")
    args = ["--frontends", "2", "--certs-dir", str(certs_dir)]
    with running_server(decoupled_repository(root / "models"), root / "server.log", args) as s:
        yield s


async def test_through_two_frontends(
    two_frontends: ServerProcess, transport: str, certs_dir: Path
) -> None:
    await assert_counted(two_frontends, transport, certs_dir)
    await assert_cancel_stops(two_frontends, transport, certs_dir)
    await assert_leaving_unread_stops(two_frontends, transport, certs_dir)


async def assert_leaving_unread_stops(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    """A caller that stopped reading, then leaves: its request is cancelled in the model,
    though its responses waited for the transport (and, through a front-end, for room in
    its stream) when it left."""
    request_id = f"unread-{transport}"
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(repeat(0, request_id, mode="forever", size=64 << 10))
        await until_id(call, request_id)
        await quiet_count(server)  # every window between it and the model full
        call.cancel()

    async def cancelled() -> bool:
        return f"request {request_id} cancelled after" in server.log_text()

    await eventually(cancelled, "the unread request was cancelled in the model")


# ---- what is refused at load ----

PADDLE_DECOUPLED = """
name: "paddle_decoupled"
platform: "paddle_inference"
max_batch_size: 64
model_transaction_policy { decoupled: true }
"""
ENSEMBLE = """
name: "chain"
platform: "ensemble"
max_batch_size: 0
input [ { name: "n", data_type: TYPE_INT32, dims: [ 1 ] },
        { name: "d", data_type: TYPE_INT32, dims: [ 1 ] },
        { name: "s", data_type: TYPE_INT32, dims: [ 1 ] },
        { name: "m", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "i", data_type: TYPE_INT32, dims: [ 1 ] } ]
ensemble_scheduling { step [ {
  model_name: "repeat"
  model_version: -1
  input_map { key: "count" value: "n" }
  input_map { key: "delay_ms" value: "d" }
  input_map { key: "size" value: "s" }
  input_map { key: "mode" value: "m" }
  output_map { key: "index" value: "i" }
} ] }
"""


# An ensemble whose one step is `chain`: the decoupled model one ensemble further in.
AROUND = (
    ENSEMBLE.split("ensemble_scheduling")[0].replace('"chain"', '"around"')
    + """
ensemble_scheduling { step [ { model_name: "chain" model_version: -1
  input_map [ { key: "n" value: "n" }, { key: "d" value: "d" },
              { key: "s" value: "s" }, { key: "m" value: "m" } ]
  output_map { key: "i" value: "i" } } ] }
"""
)


def test_a_paddle_model_and_an_ensemble_step_cannot_be_decoupled(tmp_path: Path) -> None:
    repository = decoupled_repository(tmp_path / "models")
    paddle = repository / "paddle_decoupled"
    shutil.copytree(EXAMPLE_MODELS / "mlp" / "1", paddle / "1")
    (paddle / "config.pbtxt").write_text(PADDLE_DECOUPLED)
    for name, config in (("chain", ENSEMBLE), ("around", AROUND)):
        (repository / name).mkdir()
        (repository / name / "config.pbtxt").write_text(config)
    with running_server(repository, tmp_path / "server.log", wait=False) as started:
        started.wait_loaded()
        index = started.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10).models
        # The ensemble around `chain` is never ready, and its requests say why.
        assert not started.stub.ModelReady(pb.ModelReadyRequest(name="around"), timeout=10).ready
        inputs = {k: np.array([1], np.int32) for k in "nds"} | {"m": np.array([b""], np.object_)}
        with pytest.raises(grpc.RpcError) as refused:
            started.stub.ModelInfer(build_request("around", inputs), timeout=CALL_TIMEOUT_S)
    reasons = {m.name: (m.state, m.reason) for m in index}
    assert reasons[MODEL][0] == "READY"
    state, reason = reasons["paddle_decoupled"]
    assert state == "UNAVAILABLE" and "a Paddle model cannot be decoupled" in reason
    state, reason = reasons["chain"]
    assert state == "UNAVAILABLE" and "step 1 (model 'repeat') is decoupled" in reason
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "step 1 (model 'repeat') is decoupled" in (refused.value.details() or "")


async def test_class_count_ranks_each_response_of_a_decoupled_model(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    """Triton's classification extension on a stream: each response's tensor as its top k
    (equal scores in index order), the other outputs as they are."""
    request = repeat(3, "ranked", size=4)
    request.outputs.add(name="index")
    request.outputs.add(name="data").parameters["classification"].int64_param = 2
    async with channel_to(server, transport, certs_dir) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(request)
        await call.done_writing()
        responses = await read_all(call)
    assert [r.error_message for r in responses] == [""] * 3
    for i, response in enumerate(responses):
        data = next(t for t in response.infer_response.outputs if t.name == "data")
        assert (data.datatype, list(data.shape)) == ("BYTES", [2])
        assert parse_response(response.infer_response)["data"].tolist() == [
            f"{i}:0".encode(),
            f"{i}:1".encode(),
        ]
