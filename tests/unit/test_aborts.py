"""An aborted call's request is freed when the call ends (transport/grpc/aborts.py), for a
handler of every kind registered on a grpc.aio server as start_grpc registers them: with the
cyclic collector held off, nothing the behavior saw outlives the call. Without
`ReleasingServer`, grpc.aio's own reference cycle keeps it until the collector's oldest
generation runs (each test here fails so)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import pytest

from service.observability.handlers import ObservedServer
from service.observability.logs import LineBudget, RequestLog
from service.observability.observer import Observer
from tests.unit.handler_kinds import KINDS, Request, call, handlers_of, serving
from transport.grpc.aborts import ReleasingServer
from transport.grpc.response_headers import PerConnection, ResponseHeadersServer
from transport.grpc.wrapping import Handler

SERVICE = "paddlequic.v1.Testing"
PAYLOAD = b"x" * 1024
FREED_WITHIN_S = 10.0


class Held:
    """A request that can be watched: the deserializer's result."""

    __slots__ = ("__weakref__", "message")

    def __init__(self, data: bytes) -> None:
        self.message = Request.FromString(data)


@pytest.fixture
def collector_held() -> Iterator[None]:
    """The cyclic collector off for the test: what is freed is freed by reference counts."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def aborting(seen: list[weakref.ref[Held]]) -> dict[str, Handler]:
    """One handler of each kind that reads its request(s), keeps them in its frame, and
    aborts INVALID_ARGUMENT from inside an exception handler (as the servicers do)."""

    async def refuse(kept: list[Held], context: Any) -> None:
        seen.extend(weakref.ref(r) for r in kept)
        try:
            raise ValueError("the request is refused")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def unary(request: Held, context: Any) -> Any:
        await refuse([request], context)

    async def server_stream(request: Held, context: Any) -> AsyncIterator[Any]:
        await refuse([request], context)
        yield b""

    async def client_stream(requests: AsyncIterator[Held], context: Any) -> Any:
        await refuse([r async for r in requests], context)

    async def bidi_stream(requests: AsyncIterator[Held], context: Any) -> AsyncIterator[Any]:
        await refuse([r async for r in requests], context)
        yield b""

    return handlers_of((unary, server_stream, client_stream, bidi_stream), Held, bytes)


def observer() -> Observer:
    return Observer(None, RequestLog(1e9, 0.0, None, LineBudget(10, 1.0)), None)


def observed(server: Any) -> Any:
    return ObservedServer(server, "h2", observer())


def with_headers(server: Any) -> Any:
    return ResponseHeadersServer(observed(server), (("alt-svc", 'h3=":1"'),), PerConnection(60))


@pytest.mark.parametrize("inner", [observed, with_headers])
@pytest.mark.parametrize("method", KINDS)
async def test_a_call_that_aborts_keeps_nothing_it_read(
    method: str, inner: Callable[[Any], Any], collector_held: None
) -> None:
    """As start_grpc registers every servicer: the releasing server next to grpc.aio, the
    wrapping servers (response headers, observation) inside it."""
    seen: list[weakref.ref[Held]] = []

    def register(server: Any) -> None:
        inner(ReleasingServer(server)).add_registered_method_handlers(SERVICE, aborting(seen))

    request = Request(payload=PAYLOAD).SerializeToString()
    async with serving(register) as channel:
        code, _ = await call(channel, SERVICE, method, requests=[request, request])
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert seen
        assert await freed(seen)


async def freed(seen: list[weakref.ref[Held]]) -> bool:
    """Whether everything the behavior read is freed, once the server's side of the call has
    ended (its task may still be unwinding when the client reads the status: bounded). Held
    by a reference cycle, it never would be: the collector is off."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FREED_WITHIN_S
    while any(r() is not None for r in seen):
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True
