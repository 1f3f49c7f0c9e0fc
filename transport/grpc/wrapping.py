"""Wrapping the handlers of every servicer once, at registration, on both transports: the HTTP/3
server has no interceptors, so observation and access checks come from a stand-in server that
registers wrapped handlers in the real one."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias

import grpc

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Behavior = Callable[..., Any]
MAX_CACHED_METHODS = 1024
HANDLER_BUILDERS: dict[tuple[bool, bool], Callable[..., Handler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def behavior_of(handler: Handler) -> Behavior:
    """The one behavior a handler of its kind has."""
    behavior: Behavior | None = {
        (False, False): handler.unary_unary,
        (False, True): handler.unary_stream,
        (True, False): handler.stream_unary,
        (True, True): handler.stream_stream,
    }[handler.request_streaming, handler.response_streaming]
    assert behavior is not None
    return behavior


class WrappingServer:
    """Stands in for a server (grpc.aio, H3Server or another WrappingServer) during
    registration only: every handler goes through `wrap` on its way in."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def add_generic_rpc_handlers(
        self, handlers: Iterable[grpc.GenericRpcHandler[Any, Any]]
    ) -> None:
        self._server.add_generic_rpc_handlers([WrappedGeneric(h, self.wrap) for h in handlers])

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: Mapping[str, Handler]
    ) -> None:
        self._server.add_registered_method_handlers(
            service_name,
            {m: self.wrap(f"/{service_name}/{m}", h) for m, h in method_handlers.items()},
        )

    def wrap(self, method_path: str, handler: Handler) -> Handler:
        raise NotImplementedError


class WrappedGeneric(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """A generic handler whose handlers come back wrapped (once per method)."""

    def __init__(
        self, inner: grpc.GenericRpcHandler[Any, Any], wrap: Callable[[str, Handler], Handler]
    ) -> None:
        self._inner = inner
        self._wrap = wrap
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        found = self._inner.service(handler_call_details)
        if found is None:
            return None
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not found:
            cached = (found, self._wrap(method, found))
            # A handler of any method (the unknown-method one) sees paths the peer chose:
            # past the bound they are wrapped afresh each time, not kept.
            if len(self._wrapped) < MAX_CACHED_METHODS:
                self._wrapped[method] = cached
        return cached[1]
