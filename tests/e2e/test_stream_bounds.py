"""A stream's cost is bounded per caller, on a real server with the `generate` example: a
client that never reads its generations holds their places and batch slots only for
--stream-stall-timeout (then they are cancelled, and the stream says so), other callers of
`generate` keep getting tokens meanwhile, and many connections from one address are one client
for the fair share of a version's places."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from clients.quic_channel import QuicChannel
from clients.streaming import parse_stream_response
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1 import control_pb2
from tests.conformance.conftest import EOF, H2_OPTIONS, new_channel
from tests.e2e.test_generate import MODEL, generate, generated_tokens
from tests.servers import (
    EXAMPLE_MODELS,
    ServerProcess,
    held_still,
    model_repository,
    running_server,
)
from transport.h3.settings import H3Settings

pytestmark = pytest.mark.e2e

STALL_S = 2.0  # the servers' --stream-stall-timeout here
CALL_TIMEOUT_S = 60.0  # generous: only a broken server reaches it
HOGGED = 32  # the example's generation_max_batch: every batch slot
# Each token response repeats its request's id: with ids this long (the bound), the hog's
# generations send 2.2 MB (HOGGED x LONG responses of about 350 bytes).
HOG_ID_BYTES = 256
LONG = 200  # tokens: near the model's context with the prompt
# The hog's stream window on both transports (HTTP/2's initial one). What the transports hold
# for a reader that does not read must stay well under what its generations send, so that
# the stall comes mid-generation: HTTP/2 holds this window and one message (193 responses
# here); HTTP/3 holds it and the 1 MiB the server buffers per stream (3,249). With HTTP/3's
# default 1 MiB window it held 6,115 of the 6,400 responses: the stall came at the last
# tokens, where which generations had ended depended on how far apart they ran.
HOG_WINDOW = 64 << 10
FAIR_PLACES = 4  # max_concurrent_requests of the fairness test's model
LARGE_ID_BYTES = 2 << 20
# The outbox's 4 MiB and one response, the one the transport sends, and what grpcio and
# aioquic copy on the way; a window of 65 such responses would be 260 MiB.
LARGE_ID_RSS_LIMIT = 48 << 20
QUIET_LOOKS = 25


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("stream-bounds")
    repository = model_repository(root / "models", [MODEL])
    args = ["--certs-dir", str(certs_dir), "--stream-stall-timeout", str(STALL_S)]
    with running_server(repository, root / "server.log", args) as s:
        yield s


@pytest.fixture(params=("h2", "h3"))
def transport(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def _versions(server: ServerProcess) -> tuple[int, int]:
    """The generate version's requests waiting for a place, and those holding one."""
    listed = server.control.ListInstances(
        control_pb2.ListInstancesRequest(model_name=MODEL), timeout=10
    )
    return sum(q.queued for q in listed.queues), sum(q.in_flight for q in listed.queues)


def _outcomes(server: ServerProcess) -> tuple[int, int]:
    """The generate model's requests counted as successes, and as failures."""
    stats = server.stub.ModelStatistics(pb.ModelStatisticsRequest(name=MODEL), timeout=10)
    return (
        sum(s.inference_stats.success.count for s in stats.model_stats),
        sum(s.inference_stats.fail.count for s in stats.model_stats),
    )


async def _until(check: Any, what: str) -> None:
    async with asyncio.timeout(CALL_TIMEOUT_S):
        while not await asyncio.to_thread(check):
            await asyncio.sleep(0.05)


async def _tokens_then_final(call: Any) -> tuple[int, bool]:
    """Tokens read until the request's final response, and whether one came."""
    tokens = 0
    while (message := await call.read()) is not EOF:
        response = parse_stream_response(message)
        assert response.error is None, response.error
        tokens += response.outputs.get("text_delta") is not None
        if response.final:
            return tokens, True
    return tokens, False


def _hog_channel(transport: str, server: ServerProcess, ca: Path) -> Any:
    """A reader's channel whose stream window stays at HOG_WINDOW (on HTTP/2, no BDP probing,
    which would grow it past what the hog's generations send)."""
    if transport == "h2":
        options = [*H2_OPTIONS, ("grpc.http2.bdp_probe", 0)]
        return grpc.aio.insecure_channel(server.address, options=options)
    settings = H3Settings(stream_window=HOG_WINDOW)
    return QuicChannel(f"localhost:{server.port}", ca_file=str(ca), settings=settings)


async def test_a_never_reading_stream_holds_generations_only_until_the_stall_bound(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    ca = certs_dir / "ca.pem"
    before = await asyncio.to_thread(_outcomes, server)
    async with _hog_channel(transport, server, ca) as hog_channel:
        hog = pb_grpc.GRPCInferenceServiceStub(hog_channel).ModelStreamInfer(
            timeout=CALL_TIMEOUT_S * 2
        )
        for index in range(HOGGED):
            await hog.write(generate("Once upon a time", LONG, f"{index:02d}".ljust(HOG_ID_BYTES)))
        await _until(lambda: _versions(server)[1] >= 1, "the hog's generations run")

        # Another caller of generate gets its tokens: the hog's paused generations do not
        # keep every batch slot.
        async with new_channel(transport, server, ca) as channel:
            call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                timeout=CALL_TIMEOUT_S
            )
            await call.write(generate("Hello", 8, f"good-{transport}"))
            await call.done_writing()
            assert await _tokens_then_final(call) == (8, True)

        # The hog's requests were cancelled while its connection stays open: no place held.
        await _until(lambda: _versions(server) == (0, 0), "the hog's places are freed")
        # Reading now, the hog gets what the transport held, then the stream's end, naming
        # the bound and how many requests it cancelled.
        finals = responses = 0
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while (message := await hog.read()) is not EOF:
                responses += 1
                finals += parse_stream_response(message).final
        assert responses < HOGGED * LONG * 3 // 4, "the stall came near the generations' end"
        assert ended.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        details = ended.value.details() or ""
        assert "--stream-stall-timeout" in details, details
        found = re.search(r"its (\d+) request\(s\) in flight were cancelled", details)
        assert found is not None, details
        cancelled = int(found.group(1))
        # Generations that ended before the stall may have had their last responses still
        # held for the reader: those are dropped with the stream, so fewer finals may come.
        assert 1 <= cancelled <= HOGGED and finals <= HOGGED - cancelled + 1
    # Each generation counts once: cancelled before its end, as a failure of the model; ended
    # (its final response delivered, dropped with the stream, or waiting for room in it when
    # cancelled), as a success, as the good caller's.
    after = await asyncio.to_thread(_outcomes, server)
    succeeded, failed = after[0] - before[0], after[1] - before[1]
    assert 1 <= failed <= cancelled
    assert succeeded + failed == HOGGED + 1


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


async def test_a_large_id_that_every_token_response_would_repeat_is_refused(
    server: ServerProcess, transport: str, certs_dir: Path
) -> None:
    """Every token response repeats the request's id: a 2 MiB id from a caller that does not
    read once grew the front-end by 150 MiB. Ids are bounded (256 bytes), so the stream ends
    INVALID_ARGUMENT naming the bound and nothing is generated or held for it; what else a
    response repeats is held within --stream-buffer-bytes (tests/unit/test_stream_outbox.py)."""
    pid = server.process.pid
    before = _rss(pid)
    tokens_before = await held_still(lambda: generated_tokens(server), QUIET_LOOKS, CALL_TIMEOUT_S)
    async with new_channel(transport, server, certs_dir / "ca.pem") as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(generate("Once upon a time", LONG, "x" * LARGE_ID_BYTES))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            while await call.read() is not EOF:
                pass
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "more than 256" in (refused.value.details() or "")
    assert generated_tokens(server) == tokens_before
    assert _rss(pid) - before < LARGE_ID_RSS_LIMIT, "the refused id was held"


@pytest.fixture(scope="module")
def fair_server(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    """The example with FAIR_PLACES places, on a dual-stack listener: 127.0.0.1 and ::1 are
    two clients of one machine. One process holds the calls: with --frontends N each process
    holding calls has the version's places and shares its own among its clients, and the
    kernel would spread this test's connections over them."""
    root = tmp_path_factory.mktemp("fair-share")
    model = root / "models" / MODEL
    shutil.copytree(EXAMPLE_MODELS / MODEL, model)  # the sandbox reads no link out of it
    config = (model / "config.pbtxt").read_text()
    places = f'{{ key: "max_concurrent_requests", value: {{ string_value: "{FAIR_PLACES}" }} }},'
    (model / "config.pbtxt").write_text(config.replace("parameters [", f"parameters [\n  {places}"))
    args = ["--certs-dir", str(certs_dir), "--host", "::", "--no-h3", "--frontends", "1"]
    with running_server(root / "models", root / "server.log", args) as s:
        yield s


def _channel(host: str, port: int) -> grpc.aio.Channel:
    """A connection of its own (grpcio shares one per target unless told not to)."""
    options = [*H2_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    return grpc.aio.insecure_channel(f"{host}:{port}", options=options)


async def test_many_connections_from_one_address_get_no_more_than_a_fair_share(
    fair_server: ServerProcess,
) -> None:
    """One address, a connection per request, takes every place and queues more; another
    client (::1) comes. The first place to free goes to it, not to the address's queued
    requests: it gets its whole answer before any of those gets a token."""
    port = fair_server.port
    channels = [_channel("127.0.0.1", port) for _ in range(2 * FAIR_PLACES)]
    other = _channel("[::1]", port)
    first_tokens: list[str] = []

    async def queued_one(channel: grpc.aio.Channel, name: str) -> None:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(generate("Once upon a time", LONG, name))
        await call.read()
        first_tokens.append(name)
        call.cancel()

    try:
        running = []
        for index, channel in enumerate(channels[:FAIR_PLACES]):
            call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                timeout=CALL_TIMEOUT_S
            )
            await call.write(generate("Once upon a time", LONG, f"running-{index}"))
            assert parse_stream_response(await call.read()).error is None
            running.append(call)
        waiting = [
            asyncio.create_task(queued_one(channel, f"queued-{index}"))
            for index, channel in enumerate(channels[FAIR_PLACES:])
        ]
        await _until(lambda: _versions(fair_server) == (FAIR_PLACES, FAIR_PLACES), "queued")
        call = pb_grpc.GRPCInferenceServiceStub(other).ModelStreamInfer(timeout=CALL_TIMEOUT_S)
        await call.write(generate("Hello", 4, "other-client"))
        await call.done_writing()
        await _until(lambda: _versions(fair_server)[0] == FAIR_PLACES + 1, "the other queued")
        running[0].cancel()  # a place frees: the other client holds none, the address 3
        assert await _tokens_then_final(call) == (4, True)
        assert first_tokens == []
        for call in running[1:]:
            call.cancel()
        await asyncio.gather(*waiting)
    finally:
        for channel in [*channels, other]:
            await channel.close(None)
