"""`ParsingServer` (and `WireLimitsServer` inside it): for a handler of every kind, a request
message that does not parse, or a ModelInferRequest over the wire limits, is answered
INVALID_ARGUMENT and never reaches the behavior; a stream's messages before it do."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from protos.inference import grpc_service_pb2 as pb
from service.api.request_parsing import ParsingServer
from service.api.wire_limits import MAX_TENSORS, WireLimitsServer
from tests.unit.handler_kinds import (
    KINDS,
    REQUESTS,
    TIMEOUT_S,
    Recorder,
    Request,
    Response,
    call,
    serving,
)

SERVICE = "paddlequic.v1.Testing"
GARBAGE = b"\xff"  # a field tag with no end: no message parses from it
INFER = pb.ModelInferRequest(model_name="m", inputs=[pb.ModelInferRequest.InferInputTensor()])
OVER_LIMITS = pb.ModelInferRequest(
    model_name="m", inputs=[pb.ModelInferRequest.InferInputTensor()] * (MAX_TENSORS + 1)
)


def registered(recorder: Recorder, wire_limits: bool) -> Any:
    def register(server: grpc.aio.Server) -> None:
        parsing: Any = ParsingServer(server)
        if wire_limits:
            handlers = recorder.handlers(pb.ModelInferRequest.FromString)
            WireLimitsServer(parsing).add_registered_method_handlers(SERVICE, handlers)
        else:
            parsing.add_registered_method_handlers(SERVICE, recorder.handlers())

    return register


@pytest.mark.parametrize("method", KINDS)
@pytest.mark.parametrize("wire_limits", [False, True], ids=["unparsable", "over-limits"])
async def test_a_bad_request_of_every_kind_never_reaches_the_behavior(
    method: str, wire_limits: bool
) -> None:
    recorder = Recorder()
    good = INFER if wire_limits else REQUESTS[0]
    bad = OVER_LIMITS.SerializeToString() if wire_limits else GARBAGE
    request_streaming = KINDS[method][0]
    sent = [good.SerializeToString(), bad] if request_streaming else [bad]
    async with serving(registered(recorder, wire_limits)) as channel:
        code, _ = await call(channel, SERVICE, method, requests=sent)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert recorder.seen == ([(method, good)] if request_streaming else [])
        code, _ = await call(channel, SERVICE, method, requests=[good.SerializeToString()])
    assert code == grpc.StatusCode.OK
    assert recorder.seen[-1] == (method, good)


# HTTP/2 flow control holds RESPONSE_BYTES back until the client reads: the client's stream
# window stays at its 64 KiB (no BDP probing to grow it).
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 64 << 10)]
RESPONSE_BYTES = 1 << 20


async def test_a_stream_read_by_a_task_of_its_own_is_refused_while_a_response_is_unsent() -> None:
    """ModelStreamInfer reads its requests in a task of its own. The unparsable message is read
    there while the handler's first response (initial metadata with it) is still being sent:
    the refusal waits for the handler's task, since grpc.aio's abort from the reading task
    would fail in grpc core (both sends carry the initial metadata) and send no status at all;
    the caller waited for its deadline (DEADLINE_EXCEEDED, now and then in the stream case of
    tests/e2e/test_request_bombs.py, where the first response of a connection sends alt-svc
    headers of its own first)."""
    sending, read = asyncio.Event(), asyncio.Event()

    async def reading_apart(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async def read_all() -> None:
            try:
                async for _ in requests:
                    pass
            finally:
                read.set()

        first = await anext(requests)
        reader = asyncio.create_task(read_all())
        sending.set()  # grpc starts sending the response before the client's next step
        yield Response(payload=first.payload * RESPONSE_BYTES)
        await reader

    def register(server: grpc.aio.Server) -> None:
        handler = grpc.stream_stream_rpc_method_handler(
            reading_apart,
            request_deserializer=Request.FromString,
            response_serializer=Response.SerializeToString,
        )
        ParsingServer(server).add_registered_method_handlers(SERVICE, {"BidiStream": handler})

    async with serving(register, h2_options=SMALL_WINDOW) as channel:
        rpc = channel.stream_stream(
            f"/{SERVICE}/BidiStream", response_deserializer=Response.FromString
        )(timeout=TIMEOUT_S)
        await rpc.write(REQUESTS[1].SerializeToString())
        await sending.wait()
        await rpc.write(GARBAGE)
        await read.wait()  # refused (or failed to be) while the response is unsent
        responses: list[Any] = []
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for response in rpc:
                responses.append(response)
        assert [len(r.payload) for r in responses] == [RESPONSE_BYTES]
        assert await rpc.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "failed to parse" in await rpc.details()
