"""RestrictedServer around a real grpc.aio server on a socket: every handler kind refuses a call
without the right header before its behavior runs, answers with it, and leaves other categories
open. `make mutate` found these lines of service/api/restricted.py reached by no unit test."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from service.api.restricted import RestrictedServer, parse_restrictions

SECRET = "s3cret-Value"
RESTRICTED = "paddlequic.v1.Control"  # every method of it: the `control` category
OPEN = "inference.GRPCInferenceService"  # ServerLive: `health`, not restricted here
KINDS = ("UnaryAsync", "UnarySync", "ServerStream", "ClientStream", "Bidi")


def handlers(ran: list[str]) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    """One behavior of each kind (sync and async unary), each noting that it ran."""

    async def unary_async(request: bytes, context: Any) -> bytes:
        ran.append("UnaryAsync")
        return b"unary:" + request

    def unary_sync(request: bytes, context: Any) -> bytes:
        ran.append("UnarySync")
        return b"sync:" + request

    async def server_stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        ran.append("ServerStream")
        for i in range(3):
            yield b"%d:" % i + request

    async def client_stream(requests: AsyncIterator[bytes], context: Any) -> bytes:
        ran.append("ClientStream")
        return b"+".join([r async for r in requests])

    async def bidi(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        ran.append("Bidi")
        async for request in requests:
            yield b"echo:" + request

    return {
        "UnaryAsync": grpc.unary_unary_rpc_method_handler(unary_async),
        "UnarySync": grpc.unary_unary_rpc_method_handler(unary_sync),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
        "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
    }


EXPECTED = {
    "UnaryAsync": [b"unary:q"],
    "UnarySync": [b"sync:q"],
    "ServerStream": [b"0:q", b"1:q", b"2:q"],
    "ClientStream": [b"q+r"],
    "Bidi": [b"echo:q", b"echo:r"],
}


@pytest.fixture
async def served() -> AsyncIterator[tuple[grpc.aio.Channel, list[str]]]:
    ran: list[str] = []
    server = grpc.aio.server()
    restricted = RestrictedServer(server, parse_restrictions([f"control:key={SECRET}"]))
    restricted.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(RESTRICTED, handlers(ran)),
            grpc.method_handlers_generic_handler(OPEN, {"ServerLive": handlers(ran)["UnaryAsync"]}),
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel, ran
    finally:
        await server.stop(None)


async def call_kind(
    channel: grpc.aio.Channel, path: str, kind: str, metadata: tuple[tuple[str, str], ...]
) -> list[bytes]:
    def two() -> Iterator[bytes]:
        yield from (b"q", b"r")

    if kind in ("UnaryAsync", "UnarySync"):
        return [await channel.unary_unary(path, None, None)(b"q", metadata=metadata, timeout=60)]
    if kind == "ServerStream":
        stream = channel.unary_stream(path, None, None)(b"q", metadata=metadata, timeout=60)
        return [r async for r in stream]
    if kind == "ClientStream":
        return [await channel.stream_unary(path, None, None)(two(), metadata=metadata, timeout=60)]
    return [
        r
        async for r in channel.stream_stream(path, None, None)(two(), metadata=metadata, timeout=60)
    ]


async def refusal(
    channel: grpc.aio.Channel, path: str, kind: str, metadata: tuple[tuple[str, str], ...]
) -> tuple[grpc.StatusCode, str]:
    """The status of a call that should be refused. A streaming request sends no message: the
    refusal must not wait for one (and a client still writing when the status comes fails
    its own write with INTERNAL)."""
    if kind == "ClientStream":
        call: Any = channel.stream_unary(path, None, None)(None, metadata=metadata, timeout=60)
    elif kind == "Bidi":
        call = channel.stream_stream(path, None, None)(None, metadata=metadata, timeout=60)
    else:
        try:
            await call_kind(channel, path, kind, metadata)
        except grpc.aio.AioRpcError as refused:
            return refused.code(), refused.details() or ""
        raise AssertionError(f"{kind} answered without the header")
    with contextlib.suppress(grpc.aio.AioRpcError):  # the refusal may have come first
        await call.done_writing()  # without the check, the behavior ends at once, not hangs
    return await call.code(), await call.details()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "metadata",
    [(), (("triton-grpc-protocol-key", "wrong"),), (("key", SECRET),)],
    ids=["no header", "wrong value", "unprefixed key"],
)
async def test_no_kind_runs_its_behavior_without_the_header(
    served: tuple[grpc.aio.Channel, list[str]], kind: str, metadata: tuple[tuple[str, str], ...]
) -> None:
    channel, ran = served
    code, details = await refusal(channel, f"/{RESTRICTED}/{kind}", kind, metadata)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "triton-grpc-protocol-key" in details and SECRET not in details
    assert ran == []


@pytest.mark.parametrize("kind", KINDS)
async def test_every_kind_answers_with_the_header(
    served: tuple[grpc.aio.Channel, list[str]], kind: str
) -> None:
    channel, ran = served
    metadata = (("triton-grpc-protocol-key", SECRET),)
    assert await call_kind(channel, f"/{RESTRICTED}/{kind}", kind, metadata) == EXPECTED[kind]
    assert ran == [kind]


async def test_a_category_not_restricted_stays_open(
    served: tuple[grpc.aio.Channel, list[str]],
) -> None:
    channel, ran = served
    assert await call_kind(channel, f"/{OPEN}/ServerLive", "UnaryAsync", ()) == [b"unary:q"]
    assert ran == ["UnaryAsync"]
