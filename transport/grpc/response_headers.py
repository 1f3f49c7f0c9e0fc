"""Headers added to every response of a grpc.aio server (such as `alt-svc`): grpcio has no
per-server response headers, so each handler's context joins them to the initial metadata it
sends, or sends them before the first message or the status, whichever comes first."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Sequence
from typing import Any

from transport.grpc.wrapping import HANDLER_BUILDERS, Behavior, Handler, WrappingServer, behavior_of

Headers = tuple[tuple[str, str], ...]


class ResponseHeadersServer(WrappingServer):
    """Registers every handler so that its responses carry `headers`."""

    def __init__(self, server: Any, headers: Headers) -> None:
        super().__init__(server)
        self._headers = headers

    def wrap(self, method_path: str, handler: Handler) -> Handler:
        return HANDLER_BUILDERS[handler.request_streaming, handler.response_streaming](
            _with_headers(behavior_of(handler), self._headers),
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


def _with_headers(behavior: Behavior, headers: Headers) -> Behavior:
    if inspect.isasyncgenfunction(behavior):

        async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
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
        """A unary response, or a stream sent with `context.write`."""
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
