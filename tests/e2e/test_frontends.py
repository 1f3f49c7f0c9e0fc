"""`--frontends 2`: two front-end processes on one port feeding one set of workers. Both
transports serve every kind of call, new connections reach both front-ends, 0-RTT tickets are
single use across them, an HTTP/3 client leaves a silent front-end's connection, a killed
front-end is restarted, SIGTERM leaves no process behind. Every call sends inputs of its own
and its answer is compared with in-process Paddle's for them, so an answer that reached the
wrong caller fails."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import struct
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.inference_client import build_request
from clients.quic_channel import QuicChannel
from clients.tickets import SessionTicketCache
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from scripts.migration_lab import forwarded_datagrams
from scripts.nat_rebinding import rebind
from tests.e2e.test_decoupled import decoupled_repository, index_of, repeat, until_id
from tests.e2e.test_described_calls import counter
from tests.e2e.test_shared_tickets import aimed_at, ticket_from
from tests.e2e.test_zero_rtt import infer_once, stats
from tests.reference import assert_matches_reference, call_inputs
from tests.servers import (
    EXAMPLE_MODELS,
    HTTP_PORT,
    ServerProcess,
    children,
    free_port,
    gather_held,
    model_repository,
    paused,
    refused_start,
    running_server,
    wait_logged,
)
from transport.grpc import headers as wire

pytestmark = pytest.mark.e2e

FRONTEND = "service.frontends.frontend"
LAUNCHER = "service.workers.subreaper"
PRELOADED = "service.workers.preloaded"
WAIT_S = 60.0
MAX_CONNECTIONS = 200  # new connections tried until both front-ends got one
KILLED_STREAM_READ_S = 3.0  # a stream read this long after its front-end was killed: ended
REBINDS = 20  # new client ports: the chance that none reaches the other front-end is 2^-20
CALLERS = 16  # concurrent callers, each on a connection of its own
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("frontends")
    args = ["--frontends", "2", "--certs-dir", str(certs_dir)]
    with running_server(model_repository(root / "models", ["mlp"]), root / "log", args) as s:
        yield s


def frontends(server: ServerProcess) -> set[int]:
    return {pid for pid, cmd in children(server.process.pid).items() if FRONTEND in cmd}


def metrics(server: ServerProcess) -> str:
    url = re.search(r"metrics on (http://\S+/metrics)", server.log_text())
    assert url is not None
    with urllib.request.urlopen(url.group(1), timeout=5) as response:
        return str(response.read().decode())


def calls_by_frontend(server: ServerProcess, transport: str) -> dict[str, float]:
    pattern = rf'paddlequic_frontend_calls_total{{frontend="(\d+)",transport="{transport}"}} (\S+)'
    return {index: float(count) for index, count in re.findall(pattern, metrics(server))}


def quic(server: ServerProcess, certs_dir: Path) -> QuicChannel:
    return QuicChannel(f"localhost:{server.port}", ca_file=str(certs_dir / "ca.pem"))


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.1)


async def infer_checked(stub: pb_grpc.GRPCInferenceServiceStub, call: int) -> None:
    """One ModelInfer with the inputs of call number `call`, its answer checked by value."""
    inputs = call_inputs("mlp", call)
    response = await stub.ModelInfer(build_request("mlp", inputs), timeout=30)
    assert_matches_reference("mlp", inputs, response)


async def every_kind_of_call(channel: grpc.aio.Channel | QuicChannel, first_call: int) -> None:
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    await infer_checked(stub, first_call)
    calls = range(first_call + 1, first_call + 6)

    async def requests() -> AsyncIterator[pb.ModelInferRequest]:
        for call in calls:
            yield build_request("mlp", call_inputs("mlp", call), request_id=str(call))

    answers = [r async for r in stub.ModelStreamInfer(requests(), timeout=30)]
    assert not any(a.error_message for a in answers)
    by_id = {a.infer_response.id: a.infer_response for a in answers}
    assert sorted(by_id) == sorted(str(call) for call in calls)
    for call in calls:
        assert_matches_reference("mlp", call_inputs("mlp", call), by_id[str(call)])
    assert (await stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=10)).name
    assert (await stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp"), timeout=10)).inputs
    health = health_pb2_grpc.HealthStub(channel)
    check = await health.Check(health_pb2.HealthCheckRequest(service="mlp"), timeout=10)
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ModelInfer(pb.ModelInferRequest(model_name="nope"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND


async def test_every_kind_of_call_on_both_transports(
    server: ServerProcess, certs_dir: Path
) -> None:
    async with grpc.aio.insecure_channel(server.address) as h2:
        await every_kind_of_call(h2, first_call=0)
    async with quic(server, certs_dir) as h3:
        await every_kind_of_call(h3, first_call=10)


async def test_concurrent_callers_each_get_their_own_answer(
    server: ServerProcess, certs_dir: Path
) -> None:
    """Callers on connections of their own (so on both front-ends) and both transports, each
    with inputs of its own, held until all arrived so that they share batches: every one gets
    the answer for its inputs."""

    async def caller(call: int) -> None:
        if call % 2:
            async with quic(server, certs_dir) as h3:
                await infer_checked(pb_grpc.GRPCInferenceServiceStub(h3), call)
        else:
            async with grpc.aio.insecure_channel(server.address, options=OWN_CONNECTION) as h2:
                await infer_checked(pb_grpc.GRPCInferenceServiceStub(h2), call)

    await gather_held(server, "mlp", [caller(100 + i) for i in range(CALLERS)])


async def reach_both_frontends(server: ServerProcess, certs_dir: Path, transport: str) -> None:
    """New connections until each front-end has passed a call to the parent: both are up."""
    for _ in range(MAX_CONNECTIONS):
        if transport == "h2":
            async with grpc.aio.insecure_channel(server.address, options=OWN_CONNECTION) as ch:
                await pb_grpc.GRPCInferenceServiceStub(ch).ServerLive(
                    pb.ServerLiveRequest(), timeout=10
                )
        else:
            async with quic(server, certs_dir) as h3:
                await pb_grpc.GRPCInferenceServiceStub(h3).ServerLive(
                    pb.ServerLiveRequest(), timeout=10
                )
        if set(calls_by_frontend(server, transport)) == {"0", "1"}:
            return
    raise AssertionError(f"{MAX_CONNECTIONS} new {transport} connections reached one front-end")


async def test_new_connections_reach_both_frontends(server: ServerProcess, certs_dir: Path) -> None:
    for transport in ("h2", "h3"):
        await reach_both_frontends(server, certs_dir, transport)


def test_one_set_of_workers_under_the_parent(server: ServerProcess) -> None:
    processes = children(server.process.pid)
    # Each worker runs under a launcher of its own (service/workers/subreaper.py), started
    # by the parent or forked by its preloaded launcher (service/workers/preloaded.py).
    launchers = {pid for pid, cmd in processes.items() if LAUNCHER in cmd}
    for preloaded in (pid for pid, cmd in processes.items() if PRELOADED in cmd):
        launchers.update(children(preloaded))
    workers = {pid for launcher in launchers for pid in children(launcher)}
    assert workers == {i.pid for i in server.instances("mlp")}
    assert len(frontends(server)) == 2
    for frontend in frontends(server):
        assert not children(frontend)  # front-ends start no workers


def test_sighup_to_every_process_reloads_once(server: ServerProcess) -> None:
    """What a terminal's hangup does to the process group: front-ends ignore it, the parent
    rescans the repository."""
    before = frontends(server)
    for pid in (*before, server.process.pid):
        os.kill(pid, signal.SIGHUP)
    wait_for(lambda: "SIGHUP: rescanning" in server.log_text(), "the rescan")
    assert server.log_text().count("SIGHUP: rescanning") == 1
    assert frontends(server) == before
    assert (
        pb_grpc.GRPCInferenceServiceStub(server.channel)
        .ServerReady(pb.ServerReadyRequest(), timeout=10)
        .ready
    )


def forwarded(server: ServerProcess) -> float:
    return forwarded_datagrams(metrics(server))


async def test_a_client_whose_address_changes_keeps_its_connection(
    server: ServerProcess, certs_dir: Path
) -> None:
    async with quic(server, certs_dir) as h3:
        stub = pb_grpc.GRPCInferenceServiceStub(h3)
        await infer_checked(stub, 200)
        connection = await h3.connection()
        before = forwarded(server)
        for i in range(REBINDS):
            await rebind(h3)
            await infer_checked(stub, 201 + i)
        assert await h3.connection() is connection  # never reconnected
    # Each new port lands on either front-end: some of the rebinds reached the other one.
    wait_for(lambda: forwarded(server) > before, "datagrams passed to their owner")


async def test_an_http3_client_gives_up_a_silent_frontend_and_reconnects(
    server: ServerProcess, certs_dir: Path
) -> None:
    """A front-end that stops answering (stopped here; killed, it would be as silent): the
    call in flight fails UNAVAILABLE once the channel heard nothing for its
    unresponsive_timeout_s, and the same channel's next call connects anew."""
    async with QuicChannel(
        f"localhost:{server.port}", ca_file=str(certs_dir / "ca.pem"), unresponsive_timeout_s=5.0
    ) as h3:
        stub = pb_grpc.GRPCInferenceServiceStub(h3)
        await infer_checked(stub, 300)
        first = await h3.connection()
        stopped = frontends(server)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await stub.ModelInfer(build_request("mlp", call_inputs("mlp", 301)), timeout=WAIT_S)
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no answer from the server" in (lost.value.details() or "")
        await infer_checked(stub, 302)
        assert await h3.connection() is not first


async def test_a_ticket_is_single_use_across_frontends(
    server: ServerProcess, certs_dir: Path
) -> None:
    issued = await ticket_from(server, certs_dir)
    modes = [await infer_once(server, certs_dir, aimed_at(issued, server)) for _ in range(6)]
    assert modes == ["0rtt-accepted"] + ["0rtt-rejected"] * 5


async def test_an_address_token_from_one_frontend_is_valid_at_every_one(
    server: ServerProcess, certs_dir: Path
) -> None:
    """Front-ends seal NEW_TOKEN tokens with the key made in their runtime directory: the
    token one issued, presented from REBINDS new client ports (each front-end gets some),
    validates the address every time."""
    key = SessionTicketCache.key("localhost", "localhost", server.port)
    issuing = SessionTicketCache()
    await infer_once(server, certs_dir, issuing)
    token = issuing.take_token(key)
    assert token
    before = stats(server).h3_handshakes
    for _ in range(REBINDS):
        presenting = SessionTicketCache()
        presenting.add_token(key, token)
        await infer_once(server, certs_dir, presenting)
    after = stats(server).h3_handshakes
    assert after["new_token_valid"] - before.get("new_token_valid", 0) == REBINDS
    assert after.get("new_token_unreadable", 0) == before.get("new_token_unreadable", 0)


def test_a_killed_frontend_is_restarted_and_sigterm_stops_every_process(
    tmp_path: Path, certs_dir: Path
) -> None:
    args = ["--frontends", "2", "--certs-dir", str(certs_dir)]
    with running_server(
        model_repository(tmp_path / "models", ["mlp"]), tmp_path / "log", args
    ) as s:
        before = frontends(s)
        assert len(before) == 2
        killed = min(before)
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: len(frontends(s)) == 2 and killed not in frontends(s), "a new front-end")
        wait_for(lambda: "paddlequic_frontend_restarts_total 1.0" in metrics(s), "the count")
        for call in range(10):  # new connections, whichever front-end they reach
            with grpc.insecure_channel(s.address, OWN_CONNECTION) as ch:
                inputs = call_inputs("mlp", call)
                stub = pb_grpc.GRPCInferenceServiceStub(ch)
                assert_matches_reference(
                    "mlp", inputs, stub.ModelInfer(build_request("mlp", inputs), timeout=30)
                )
        everything = set(children(s.process.pid))
        assert s.stop() == 0
    # multiprocessing's resource tracker exits once the parent is gone: wait, do not race it.
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in everything), "no process")


async def test_a_killed_front_ends_generations_are_cancelled_and_the_others_go_on(
    tmp_path: Path, certs_dir: Path
) -> None:
    """A decoupled model's worker takes each front-end's requests on that front-end's own
    socket. A front-end killed mid-generation: the worker cancels the requests that came on
    its socket (the model sees is_cancelled(), and says so), and goes on with the other
    front-end's, whose stream never notices, and the restarted front-end's."""
    repository = decoupled_repository(model_repository(tmp_path / "models", ["mlp"]))
    args = ["--frontends", "2", "--certs-dir", str(certs_dir)]
    with running_server(repository, tmp_path / "log", args) as s:
        held: dict[str, tuple[grpc.aio.Channel, Any, str]] = {}  # by front-end index
        try:
            for n in range(MAX_CONNECTIONS):  # until each front-end holds a generation
                before = stream_requests_by_frontend(s)
                channel = grpc.aio.insecure_channel(s.address, OWN_CONNECTION)
                call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=120)
                request_id = f"gen-{n}"
                await call.write(repeat(0, request_id, mode="forever", delay_ms=20))
                await until_id(call, request_id)
                after = stream_requests_by_frontend(s)
                (frontend,) = [k for k, v in after.items() if v != before.get(k, 0)]
                if frontend in held:
                    await channel.close(None)
                    continue
                held[frontend] = (channel, call, request_id)
                if len(held) == 2:
                    break
            assert len(held) == 2, "no connection reached the second front-end"
            pids = frontends(s)
            victim = min(pids)
            os.kill(victim, signal.SIGKILL)
            lost, kept = [], []  # the generations of the killed front-end, of the other
            for _, call, request_id in held.values():
                ids: set[str] = set()  # of the responses this stream read
                try:
                    # Longer than the killed one's responses on their way last (what its
                    # client buffered while the test looked for the second front-end can be
                    # many: a count of them was flaky on a loaded machine).
                    reading = time.monotonic() + KILLED_STREAM_READ_S
                    while time.monotonic() < reading:
                        seen = await until_id(call, request_id)
                        ids.update(r.infer_response.id for r in seen)
                    kept.append((call, request_id))
                except (grpc.aio.AioRpcError, AssertionError):  # failed, or ended
                    lost.append(request_id)
                # Both front-ends number their requests from 1: neither got the other's.
                assert ids <= {request_id}, f"{request_id} read responses of {ids}"
            assert len(lost) == len(kept) == 1
            wait_for(lambda: f"request {lost[0]} cancelled after" in s.log_text(), "the cancel")
            wait_for(lambda: len(frontends(s)) == 2 and victim not in frontends(s), "a restart")
            # The survivor's generation still runs, and a new connection's (either front-end).
            ((call, request_id),) = kept
            await until_id(call, request_id)
            async with grpc.aio.insecure_channel(s.address, OWN_CONNECTION) as fresh:
                requests = iter([repeat(3, "fresh")])
                stub = pb_grpc.GRPCInferenceServiceStub(fresh)
                answers = [r async for r in stub.ModelStreamInfer(requests, timeout=60)]
                assert [index_of(a) for a in answers] == [0, 1, 2]
            assert f"request {request_id} cancelled after" not in s.log_text()
        finally:
            for channel, _, _ in held.values():
                await channel.close(None)


async def test_a_decoupled_model_reloaded_while_front_ends_generate(
    tmp_path: Path, certs_dir: Path
) -> None:
    """A new version of a decoupled model while a front-end's generation runs on the old one:
    new requests reach the new version's workers (each front-end attaches a socket to them),
    the old generation runs on until its caller ends it, and the old version then stops at
    once, not at its wind-down timeout: it waits for every front-end to let it go."""
    repository = decoupled_repository(tmp_path / "models")
    args = ["--frontends", "2", "--certs-dir", str(certs_dir)]
    args += ["--model-control-mode", "explicit", "--load-model", "repeat"]
    with running_server(repository, tmp_path / "log", args) as s:
        async with grpc.aio.insecure_channel(s.address, OWN_CONNECTION) as channel:
            old = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=120)
            await old.write(repeat(0, "old", mode="forever", delay_ms=20))
            (first,) = await until_id(old, "old")
            assert first.infer_response.model_version == "1"
            shutil.copytree(repository / "repeat" / "1", repository / "repeat" / "2")
            load = pb.RepositoryModelLoadRequest(model_name="repeat")
            await asyncio.to_thread(s.stub.RepositoryModelLoad, load, timeout=120)
            for n in range(4):  # new connections, whichever front-end they reach
                async with grpc.aio.insecure_channel(s.address, OWN_CONNECTION) as fresh:
                    stub = pb_grpc.GRPCInferenceServiceStub(fresh)
                    requests = iter([repeat(3, f"new-{n}")])
                    answers = [r async for r in stub.ModelStreamInfer(requests, timeout=60)]
                assert [(index_of(a), a.infer_response.model_version) for a in answers] == [
                    (0, "2"),
                    (1, "2"),
                    (2, "2"),
                ]
            for _ in range(5):  # the old generation runs on, on the old version
                (response,) = await until_id(old, "old")
                assert response.infer_response.model_version == "1"
            assert "model repeat version 1 replaced" not in s.log_text()
            old.cancel()
        wait_logged(s, "model repeat version 1 replaced; its workers stopped", limit_s=30)


def test_completions_run_in_the_front_ends_with_their_parent_stopped(
    tmp_path: Path, certs_dir: Path
) -> None:
    """OpenAI's completions name their model in the body: a front-end reads it and, on a
    generation model it serves itself, runs the generation there, its tokens read from its
    own socket to the worker. Held still by SIGSTOP, the parent passes nothing on, and
    completions, whole and streamed, are still answered, each new connection's the greedy
    text the first one got, and so is a batchstream (a front-end serving every generation
    model takes it: each line's generation, a line naming no model given the only one, one
    naming no generation model failing alone); a completion naming no generation model is
    refused as the parent refuses it, once the parent runs again."""
    repository = tmp_path / "models"
    repository.mkdir()
    (repository / "generate").symlink_to(EXAMPLE_MODELS / "generate")
    args = ["--frontends", "2", "--certs-dir", str(certs_dir), "--http-port", HTTP_PORT]
    body = {"model": "generate", "prompt": "Once upon a time", "max_tokens": 8}

    def complete(document: dict[str, Any]) -> httpx.Response:
        base = f"{s.http_url}/v1"
        with httpx.Client(base_url=base, timeout=60) as client:  # a new connection each
            return client.post("/completions", json=document)

    def batchstream() -> set[tuple[str, str | None, Any]]:
        """Each event of a batchstream of three lines: its name, request and outcome."""
        named = [{**body, "request_id": "a"}, {"prompt": body["prompt"], "max_tokens": 8}]
        named[1]["request_id"] = "b"
        named.append({**body, "request_id": "c", "model": "nothing"})
        sent = b"".join(json.dumps(line).encode() + b"\n" for line in named)
        with httpx.Client(base_url=f"{s.http_url}/v1", timeout=60) as client:
            answer = client.post("/inference/advanced/batchstream", content=sent)
        assert answer.status_code == 200, answer.text
        events: set[tuple[str, str | None, Any]] = set()
        for block in answer.content.decode().strip().split("\n\n"):
            name, data = (line.split(": ", 1)[1] for line in block.splitlines())
            event = json.loads(data)
            if name == "done":
                counts = (event["requests"], event["completed"], event["failed"])
                events.add((name, None, counts))
            else:
                events.add((name, event["request_id"], event.get("text", event.get("code"))))
        return events

    with running_server(repository, tmp_path / "log", args) as s:
        first = complete(body)
        assert first.status_code == 200, first.text
        text = first.json()["choices"][0]["text"]
        assert text
        for _ in range(4):  # each front-end's socket to the worker attached
            assert complete(body).json()["choices"][0]["text"] == text
        with paused(s.process.pid):
            for _ in range(4):
                assert complete(body).json()["choices"][0]["text"] == text
                streamed = complete({**body, "stream": True})
                chunks = streamed.content.split(b"\n\n")
                assert chunks[-2:] == [b"data: [DONE]", b""]
                pieces = [json.loads(c.removeprefix(b"data: ")) for c in chunks[:-2]]
                assert "".join(p["choices"][0]["text"] for p in pieces) == text
                assert batchstream() == {
                    ("completion", "a", text),
                    ("completion", "b", text),  # it names no model: the only one
                    ("error", "c", "not_found"),
                    ("done", None, (3, 2, 1)),
                }
        refused = complete({**body, "model": "nothing"})
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "not_found"


def stream_requests_by_frontend(server: ServerProcess) -> dict[str, float]:
    """paddlequic_frontend_stream_requests_total{ran="here"}, by front-end."""
    pattern = r'paddlequic_frontend_stream_requests_total{frontend="(\d+)",ran="here"} (\S+)'
    return {index: float(count) for index, count in re.findall(pattern, metrics(server))}


RESTRICTION_KEY = "frontends-Secret"
RESTRICTED_HEADER = ("triton-grpc-protocol-key", RESTRICTION_KEY)


def requests_counted(server: ServerProcess, transport: str, rpc: str) -> dict[str, float]:
    """paddlequic_requests_total of `rpc` on `transport`, by code, in the parent's /metrics."""
    pattern = (
        rf'^paddlequic_requests_total{{code="(\w+)",model="",rpc="{rpc}",'
        rf'transport="{transport}",version=""}} (\S+)$'
    )
    return {code: float(count) for code, count in re.findall(pattern, metrics(server), re.M)}


def requests_logged(server: ServerProcess, transport: str, rpc: str) -> list[str]:
    """The status of every request-log line for `rpc` on `transport`, whichever process
    wrote it (the front-ends write to the same log as the parent)."""

    lines = server.log_objects()
    return [
        line["status"]
        for line in lines
        if line.get("event") == "request"
        and (line.get("transport"), line.get("rpc")) == (transport, rpc)
    ]


def pids_alive(pids: set[int]) -> set[int]:
    """Those of `pids` still running (a zombie, exited but not yet reaped, is not)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def test_restricted_protocols_metrics_and_request_logs_run_once_in_the_parent(
    tmp_path: Path, certs_dir: Path
) -> None:
    """Each call through a front-end is refused (or served), counted and logged once, by the
    parent, under the transport it came in on. Then, on SIGTERM, front-ends that do not stop
    (stopped here) are killed after the grace period, and the parent exits."""
    args = [
        "--frontends", "2", "--certs-dir", str(certs_dir),
        "--restricted-protocol", "metadata:key=" + RESTRICTION_KEY,
        "--log-format", "json", "--log-sample-ratio", "1", "--grace-period", "1",
    ]  # fmt: skip
    with running_server(model_repository(tmp_path / "models", []), tmp_path / "log", args) as s:

        async def calls() -> None:
            async with grpc.aio.insecure_channel(s.address) as h2, quic(s, certs_dir) as h3:
                for channel in (h2, h3):
                    stub = pb_grpc.GRPCInferenceServiceStub(channel)
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=WAIT_S)
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    served = await stub.ServerMetadata(
                        pb.ServerMetadataRequest(), metadata=[RESTRICTED_HEADER], timeout=WAIT_S
                    )
                    assert served.name

        asyncio.run(calls())
        # Observation ends before the status is sent: every line and count of these calls,
        # in any process, is there once the client has its answer.
        for transport in ("h2", "h3"):
            counted = requests_counted(s, transport, "ServerMetadata")
            assert counted == {"OK": 1.0, "UNAUTHENTICATED": 1.0}, transport
            logged = requests_logged(s, transport, "ServerMetadata")
            assert sorted(logged) == ["OK", "UNAUTHENTICATED"], transport

        stopped = frontends(s)
        assert len(stopped) == 2
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            s.process.send_signal(signal.SIGTERM)
            assert s.process.wait(WAIT_S) == 0
            assert s.log_text().count("did not stop; killing it") == 2
            wait_for(lambda: not pids_alive(stopped), "the stopped front-ends gone")
        finally:
            for pid in pids_alive(stopped):
                os.kill(pid, signal.SIGKILL)


async def test_a_frontend_stops_when_its_parent_dies(tmp_path: Path, certs_dir: Path) -> None:
    args = ["--frontends", "2", "--certs-dir", str(certs_dir), "--grace-period", "1"]
    with running_server(model_repository(tmp_path / "models", []), tmp_path / "log", args) as s:
        # Both connected to the parent first (the parent is ready before its front-ends are).
        await reach_both_frontends(s, certs_dir, "h2")
        orphans = frontends(s)
        assert len(orphans) == 2
        everything = set(children(s.process.pid))
        s.process.kill()
        s.process.wait(WAIT_S)
        try:
            wait_for(lambda: not pids_alive(orphans), "the front-ends to stop")
        finally:
            for pid in pids_alive(everything):
                os.kill(pid, signal.SIGKILL)
    for index in (0, 1):
        assert f"front-end {index}: the parent is gone; stopping" in s.log_text()


async def test_ready_in_the_log_means_every_front_end_listens(
    tmp_path: Path, certs_dir: Path
) -> None:
    """The log's "ready" line comes once every front-end accepts calls (as ServerReady): a
    call made the moment it is written connects on both transports. (Front-ends start their
    listeners after the parent has loaded; the line used to come first.)"""
    args = ["--frontends", "2", "--certs-dir", str(certs_dir)]
    repository = model_repository(tmp_path / "models", [])
    with running_server(repository, tmp_path / "log", args, wait=False) as s:
        wait_logged(s, "ready: 0 model version(s) loaded", WAIT_S)
        for _ in range(4):  # new connections, each to either front-end
            async with grpc.aio.insecure_channel(s.address, options=OWN_CONNECTION) as h2:
                ready = await pb_grpc.GRPCInferenceServiceStub(h2).ServerReady(
                    pb.ServerReadyRequest(), timeout=10
                )
                assert ready.ready
            async with quic(s, certs_dir) as h3:
                ready = await pb_grpc.GRPCInferenceServiceStub(h3).ServerReady(
                    pb.ServerReadyRequest(), timeout=10
                )
                assert ready.ready


def test_a_udp_port_another_process_shares_stops_the_start(tmp_path: Path, certs_dir: Path) -> None:
    """Another process's SO_REUSEPORT socket on the UDP port (a second server of this user):
    front-ends binding with SO_REUSEPORT would join its group and the kernel would spread
    clients' datagrams over both servers. The start stops instead, naming the port."""
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", port))
        repository = model_repository(tmp_path / "models", [])
        args = ["--model-repository", str(repository), "--certs-dir", str(certs_dir)]
        args += ["--host", "127.0.0.1", "--grpc-port", str(port), "--metrics-port", "0"]
        args += ["--http-port", "0", "--frontends", "2"]
        refused = refused_start(args)
    assert f"UDP port {port} (HTTP/3): Address already in use" in refused


@pytest.mark.parametrize(
    ("path", "rpc"),
    [
        ("/random.Service/Z3f9", "_unknown"),
        ("/inference.GRPCInferenceService/ServerLive", "ServerLive"),
    ],
)
async def test_a_call_a_front_ends_http3_transport_answers_itself_is_counted(
    server: ServerProcess, certs_dir: Path, path: str, rpc: str
) -> None:
    """A call refused by the HTTP/3 transport before any handler (an encoding it does not
    take) is answered in the front-end and never reaches the parent: the front-end counts
    it, and the parent's /metrics shows it once, under its method if the parent serves one
    by that path (METHODS), else under `_unknown`."""

    def refused() -> float:
        labels = {"transport": "h3", "rpc": rpc, "code": "UNIMPLEMENTED"}
        return counter(server, "paddlequic_requests_total", **labels)

    before = refused()
    block = [
        *wire.request_headers(f"localhost:{server.port}", path, None),
        (b"grpc-encoding", b"snappy"),
    ]
    assert await h3_raw_call(server, certs_dir, block, b"", end=True) == b"12"
    wait_for(lambda: refused() >= before + 1, "the refused call counted")
    assert refused() == before + 1


async def test_a_call_whose_deadline_passes_during_its_upload_is_counted(
    server: ServerProcess, certs_dir: Path
) -> None:
    """A unary call the front-end passes on (ModelMetadata) whose message never comes whole:
    its deadline passes before the parent's handler runs, and the parent counts it as the
    HTTP/3 transport of a single process does, once, DEADLINE_EXCEEDED."""
    method = "/inference.GRPCInferenceService/ModelMetadata"

    def timed_out() -> float:
        labels = {"transport": "h3", "rpc": "ModelMetadata", "code": "DEADLINE_EXCEEDED"}
        return counter(server, "paddlequic_requests_total", **labels)

    before = timed_out()
    block = wire.request_headers(f"localhost:{server.port}", method, 1.0)
    half_message = struct.pack(">BI", 0, 64)
    assert await h3_raw_call(server, certs_dir, block, half_message) == b"4"
    wait_for(lambda: timed_out() >= before + 1, "the timed-out call counted")
    assert timed_out() == before + 1


async def h3_raw_call(
    server: ServerProcess,
    certs_dir: Path,
    block: list[tuple[bytes, bytes]],
    body: bytes,
    end: bool = False,
) -> bytes:
    """A hand-written HTTP/3 request (its upload left open unless `end`): the grpc-status."""
    async with quic(server, certs_dir) as channel:
        stream = (await channel.connection()).open_stream()
        stream.send_headers(block)
        await stream.send_data(body, end=end)
        answer = dict(await asyncio.wait_for(stream.wait_headers(), WAIT_S))
    return answer[b"grpc-status"]
