"""Headers a grpc.aio server adds to its responses (such as `alt-svc`): grpcio has no
per-server response headers, so each handler's context joins them to the initial metadata it
sends, or sends them before the first message or the status, whichever comes first.

Sending initial metadata of its own costs a call one more batch through grpc core (80 us of
the server's CPU per ModelInfer on `mlp`, 12%), so the headers go on the first response of
each connection and again once `refresh_s` has passed on it, not on every response."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from transport.grpc.wrapping import HANDLER_BUILDERS, Behavior, Handler, WrappingServer, behavior_of

Headers = tuple[tuple[str, str], ...]


MAX_CONNECTIONS = 4096


class PerConnection:
    """Which responses carry the headers: the first of each connection (its peer address), then
    one every `refresh_s` on it. At most `max_connections` are remembered, the least recently
    advertised forgotten first; a forgotten one, or a new connection from a port a closed one
    used, is told again at worst `refresh_s` later."""

    def __init__(self, refresh_s: float, max_connections: int = MAX_CONNECTIONS) -> None:
        self._refresh_s = refresh_s
        self._max = max_connections
        self._sent: OrderedDict[str, float] = OrderedDict()  # peer -> when last advertised

    def due(self, peer: str, now: float) -> bool:
        last = self._sent.get(peer)
        if last is not None and now - last < self._refresh_s:
            return False
        self._sent[peer] = now
        self._sent.move_to_end(peer)
        while len(self._sent) > self._max:
            self._sent.popitem(last=False)
        return True


class ResponseHeadersServer(WrappingServer):
    """Registers every handler so that its responses carry `headers` when `schedule` says."""

    def __init__(
        self,
        server: Any,
        headers: Headers,
        schedule: PerConnection,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(server)
        self._headers = headers
        self._schedule = schedule
        self._clock = clock

    def _headers_for(self, context: Any) -> Headers:
        return self._headers if self._schedule.due(context.peer(), self._clock()) else ()

    def wrap(self, method_path: str, handler: Handler) -> Handler:
        return HANDLER_BUILDERS[handler.request_streaming, handler.response_streaming](
            _with_headers(behavior_of(handler), self._headers_for),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class _Context:
    """The servicer context, sending `headers` with the initial metadata exactly once."""

    def __init__(self, context: Any, headers: Headers) -> None:
        self._context = context
        self._headers = headers
        self._sent = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, Any]]) -> None:
        self._sent = True
        await self._context.send_initial_metadata((*metadata, *self._headers))

    async def write(self, message: Any) -> None:
        await self.send_headers()
        await self._context.write(message)

    async def abort(
        self, code: Any, details: str = "", trailing_metadata: Sequence[tuple[str, Any]] = ()
    ) -> None:
        """After an abort nothing more can be sent, so the headers go first."""
        await self.send_headers_on_error()
        await self._context.abort(code, details, trailing_metadata)

    async def send_headers(self) -> None:
        if not self._sent:
            await self.send_initial_metadata(())

    async def send_headers_on_error(self) -> None:
        """A failed call's status becomes trailers after these headers; a call that can no
        longer send anything (cancelled, or its status already went) is left as it is."""
        with contextlib.suppress(Exception):
            await self.send_headers()


def _with_headers(behavior: Behavior, headers_for: Callable[[Any], Headers]) -> Behavior:
    if inspect.isasyncgenfunction(behavior):

        async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
            headers = headers_for(context)
            if not headers:
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
                return
            wrapped = _Context(context, headers)
            try:
                async with contextlib.aclosing(behavior(request, wrapped)) as responses:
                    async for response in responses:
                        await wrapped.send_headers()
                        yield response
            except Exception:  # not a cancellation, nor the generator being closed
                await wrapped.send_headers_on_error()
                raise
            await wrapped.send_headers()

        return streaming

    async def single(request: Any, context: Any) -> Any:
        """A unary response, or a stream sent with `context.write`; a call with no headers
        due runs on the context as it is (no proxy between the servicer and grpc)."""
        headers = headers_for(context)
        if not headers:
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        wrapped = _Context(context, headers)
        try:
            result = behavior(request, wrapped)
            response = await result if inspect.isawaitable(result) else result
        except Exception:  # not a cancellation
            await wrapped.send_headers_on_error()
            raise
        await wrapped.send_headers()
        return response

    return single
