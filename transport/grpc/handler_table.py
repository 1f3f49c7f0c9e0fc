"""grpc.aio.Server's registration API for servers of our own (HTTP/3, the front-ends'
dispatch endpoint), so `add_XServicer_to_server(servicer, server)` registers on them too, and
how such a server calls a handler."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

import grpc


@dataclass(frozen=True)
class _CallDetails:
    """grpc.HandlerCallDetails for generic handlers."""

    method: str
    invocation_metadata: tuple[tuple[str, str | bytes], ...]


class HandlerTable:
    def __init__(self) -> None:
        self._registered: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        self._generic: list[grpc.GenericRpcHandler[Any, Any]] = []

    def add_generic_rpc_handlers(
        self, handlers: Iterable[grpc.GenericRpcHandler[Any, Any]]
    ) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        for method, handler in method_handlers.items():
            self._registered[f"/{service_name}/{method}"] = handler

    def registered(self, method: str) -> bool:
        """Whether `method` is one of the registered methods (a bounded set, unlike the paths
        generic handlers may take)."""
        return method in self._registered

    def methods(self) -> list[str]:
        """The registered methods' paths, sorted."""
        return sorted(self._registered)

    def lookup(
        self, method: str, metadata: tuple[tuple[str, str | bytes], ...]
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        """As grpc.aio looks: registered methods first, then generic handlers in order."""
        handler = self._registered.get(method)
        if handler is not None:
            return handler
        details = _CallDetails(method, metadata)
        for generic in self._generic:
            found = generic.service(details)  # type: ignore[arg-type]
            if found is not None:
                return found
        return None


class _Writer(Protocol):
    async def write(self, message: Any) -> None: ...


async def run_behavior(
    handler: grpc.RpcMethodHandler[Any, Any], request: Any, context: _Writer
) -> None:
    """Call the handler's behavior as its kind requires (a coroutine, an async or a plain
    generator) and write what it returns through the context."""
    if handler.response_streaming:
        method = handler.stream_stream if handler.request_streaming else handler.unary_stream
        assert method is not None
        result = method(request, cast(Any, context))
        if hasattr(result, "__aiter__"):
            async for response in result:
                await context.write(response)
        elif inspect.isawaitable(result):
            await result
        elif result is not None:
            for response in result:
                await context.write(response)
        return
    method = handler.stream_unary if handler.request_streaming else handler.unary_unary
    assert method is not None
    response = method(request, cast(Any, context))
    if inspect.isawaitable(response):
        response = await response
    if response is not None:
        await context.write(response)
