"""Request messages that fail to parse get INVALID_ARGUMENT naming the message, on every
transport, as an answer of the handler: observed (counted, logged within the request log's
budget) like any other. grpcio answers a deserializer that raises with UNKNOWN and logs a
traceback per request, a log flood for anyone who sends garbage; HTTP/3 answered INTERNAL.

Servicers register through `ParsingServer`, innermost of the wrapping servers: each handler's
deserializer returns an `Unparsable` instead of raising, and its behavior aborts on it.

A stream's message is refused by the handler's own task, never by the task that read it: a
servicer may read its requests in a task of its own (ModelStreamInfer does), and grpc.aio's
abort from that task while the handler's task has a send in flight (the first response, or
the initial metadata) fails in grpc core (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS: both batches
send the initial metadata), leaving a call that sends no status until the caller's deadline."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from transport.grpc.wrapping import HANDLER_BUILDERS, Behavior, Handler, WrappingServer, behavior_of

Deserializer = Callable[[bytes], Any]


@dataclass(frozen=True)
class Unparsable:
    """What a tolerant deserializer returns for bytes that are not its message."""

    details: str


def message_name(deserializer: Deserializer) -> str:
    """`inference.ModelInferRequest` for `ModelInferRequest.FromString`; the function's name
    for other deserializers. Wrappers made with functools.wraps are looked through."""
    deserializer = inspect.unwrap(deserializer)
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    name = getattr(descriptor, "full_name", None)
    return name if isinstance(name, str) else getattr(deserializer, "__qualname__", "request")


def tolerant(deserializer: Deserializer) -> Deserializer:
    name = message_name(deserializer)

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return Unparsable(f"failed to parse {name}: {exc or type(exc).__name__}")

    return parse


async def refuse_unparsable(request: Any, context: Any) -> None:
    if isinstance(request, Unparsable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)


class UnparsableInStream(Exception):
    """Raised where a stream's unparsable message is read; the handler's own task refuses it."""

    def __init__(self, unparsable: Unparsable) -> None:
        super().__init__(unparsable.details)
        self.details = unparsable.details


async def _parsed(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Unparsable):
            raise UnparsableInStream(request)
        yield request


@contextlib.asynccontextmanager
async def _refusing(context: Any) -> AsyncIterator[None]:
    """Runs the behavior; a stream message that did not parse, met anywhere in it, ends the
    call INVALID_ARGUMENT from here (the handler's task, between sends)."""
    try:
        yield
    except UnparsableInStream as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.details)


class ParsingServer(WrappingServer):
    """Registers every handler with a tolerant deserializer and a behavior that refuses what
    did not parse. A synchronous behavior (none of ours) keeps its deserializer as it is."""

    def wrap(self, method_path: str, handler: Handler) -> Handler:
        behavior = behavior_of(handler)
        if handler.request_deserializer is None or not (
            inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)
        ):
            return handler
        return HANDLER_BUILDERS[handler.request_streaming, handler.response_streaming](
            _checking(behavior, handler.request_streaming),
            request_deserializer=tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


def _checking(behavior: Behavior, request_streaming: bool) -> Behavior:
    """The behavior, seeing only requests that parsed: a unary request is checked before it
    runs, a stream's as they are read."""
    if inspect.isasyncgenfunction(behavior):

        async def checked_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            if request_streaming:
                request = _parsed(request)
            else:
                await refuse_unparsable(request, context)
            async with (
                _refusing(context),
                contextlib.aclosing(behavior(request, context)) as responses,
            ):
                async for response in responses:
                    yield response

        return checked_stream

    async def checked(request: Any, context: Any) -> Any:
        if not request_streaming:
            await refuse_unparsable(request, context)
            return await behavior(request, context)
        async with _refusing(context):
            return await behavior(_parsed(request), context)

    return checked
