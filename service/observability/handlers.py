"""Every RPC observed on every transport without the transports knowing: servicers register
through `ObservedServer`, which wraps each grpc.RpcMethodHandler's behavior to count, time,
trace and log the call, and otherwise passes requests, responses and errors through as is."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
from grpc.aio import AbortError, InternalError
from opentelemetry import context as otel_context

from service.observability.metrics import UNKNOWN
from service.observability.observer import Observation, Observer, deadline_passed
from transport.grpc.wrapping import HANDLER_BUILDERS, Behavior, Handler, WrappingServer, behavior_of
from transport.h3.server import H3Server
from transport.h3.stream_state import StreamClosed

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class ObservedServer(WrappingServer):
    """Registers every handler observed (metrics, traces, request logs)."""

    def __init__(self, server: Any, transport: str, observer: Observer) -> None:
        """Calls an HTTP/3 server answers itself are observed too (grpc.aio tells nothing of
        those)."""
        super().__init__(server)
        self._transport = transport
        self._observer = observer
        if isinstance(server, H3Server):
            server.answered = lambda answer: observer.transport_answered(transport, answer)

    def observe_unknown_methods(self) -> None:
        """grpc.aio answers a method nobody serves by itself, unseen: a generic handler, once
        registered after every other, answers it the same (UNIMPLEMENTED), observed under
        rpc `UNKNOWN` whatever the path (the label stays bounded)."""
        handler = grpc.stream_stream_rpc_method_handler(_unimplemented)
        self._server.add_generic_rpc_handlers(
            [_AnyMethod(self.wrap(f"/{UNKNOWN}/{UNKNOWN}", handler))]
        )

    def wrap(self, method_path: str, handler: Handler) -> Handler:
        """The same handler kind with an observed behavior; a synchronous behavior (none of
        ours) is left as it is."""
        streaming = (handler.request_streaming, handler.response_streaming)
        behavior = behavior_of(handler)
        if inspect.isasyncgenfunction(behavior):
            observed = self._async_generator(method_path, behavior, handler.request_streaming)
        elif inspect.iscoroutinefunction(behavior):
            observed = self._coroutine(method_path, behavior, handler.request_streaming)
        else:
            return handler
        return HANDLER_BUILDERS[streaming](
            observed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _coroutine(self, method_path: str, behavior: Behavior, request_streaming: bool) -> Behavior:
        async def observed(request: Any, context: Any) -> Any:
            call = ObservedCall(self._observer, self._transport, method_path, context)
            request = call.requests(request) if request_streaming else call.saw(request)
            try:
                response = await behavior(request, context)
            except BaseException as exc:
                call.finish(exc)
                raise
            call.finish(None, response)
            return response

        return observed

    def _async_generator(
        self, method_path: str, behavior: Behavior, request_streaming: bool
    ) -> Behavior:
        async def observed(request: Any, context: Any) -> AsyncIterator[Any]:
            call = ObservedCall(self._observer, self._transport, method_path, context)
            request = call.requests(request) if request_streaming else call.saw(request)
            responses = observed_responses(call, behavior(request, context))
            async with contextlib.aclosing(responses) as answers:
                async for response in answers:
                    yield response

        return observed


async def _unimplemented(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found")
    yield b""  # never reached: makes this an async generator, as stream_stream handlers are


class _AnyMethod(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """Serves every method with one handler."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler:
        return self._handler


async def observed_responses(
    call: ObservedCall, responses: AsyncGenerator[Any, None]
) -> AsyncGenerator[Any, None]:
    """A streaming behavior's responses, its call recorded when they end (or fail)."""
    try:
        async with contextlib.aclosing(responses) as answers:
            async for response in answers:
                yield response
    except BaseException as exc:
        call.finish(exc)
        raise
    call.finish(None)


class ObservedCall(Observation):
    """A wrapped behavior's call: its span current in the behavior's task throughout, its
    status read from its servicer context."""

    def __init__(self, observer: Observer, transport: str, method_path: str, context: Any) -> None:
        super().__init__(observer, transport, method_path, context.invocation_metadata)
        self.context = context
        self._token = self.attach()
        # A streaming behavior may be finished in another task: grpc.aio closes the generator
        # of a call whose client left from its own finalizer, where the token (of this task's
        # context) cannot be detached (opentelemetry logged "Failed to detach context" at
        # error level for each). This task's context then ends with the task.
        self._task = asyncio.current_task()

    async def requests(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            yield self.saw(request)

    def finish(self, error: BaseException | None, response: Any = None) -> None:
        context = self.context
        if self._token is not None and asyncio.current_task() is self._task:
            otel_context.detach(self._token)
        self.end(_status(error, context), lambda: _details(error, context), response)


def _status(error: BaseException | None, context: Any) -> grpc.StatusCode:
    """The status the transport will send for a behavior that returned or raised `error`.
    Once the deadline passed, that is DEADLINE_EXCEEDED whatever the behavior did: an answer
    that races the deadline (an abort, a response) fails to go out (grpcio raises
    ExecuteBatchError), and the client's own deadline has fired; a cancel close to it is the
    deadline too. So is an answer that failed to go out (an InternalError, ExecuteBatchError's
    base: the transport had ended the call) close to it: the client's cancel at its deadline
    can end the call before the context says it was cancelled."""
    ended = isinstance(error, asyncio.CancelledError | GeneratorExit | InternalError)
    cancelled = context.cancelled() or ended
    if deadline_passed(context.time_remaining(), cancelled):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if error is None or isinstance(error, AbortError):
        code = context.code()
        if isinstance(code, int):
            code = _CODES.get(code)
        return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.OK
    if isinstance(error, StreamClosed):
        return error.status
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


def _details(error: BaseException | None, context: Any) -> str:
    """The status message the caller gets, or what went wrong if the transport makes it."""
    if error is None or isinstance(error, AbortError):
        details = context.details()
        return details.decode(errors="replace") if isinstance(details, bytes) else str(details)
    if isinstance(error, StreamClosed):
        return error.message
    return repr(error)
