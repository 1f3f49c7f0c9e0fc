"""Wrapped handlers are kept per method, up to a bound: a handler of any method (the
unknown-method one) must not let a peer grow the server's memory with made-up paths."""

from __future__ import annotations

from typing import Any

import grpc

from transport.grpc.wrapping import MAX_CACHED_METHODS, Handler, WrappedGeneric


class _AnyMethod(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)

    def service(self, handler_call_details: Any) -> Handler:
        return self.handler


class _Details:
    def __init__(self, method: str) -> None:
        self.method = method


def test_wrapped_handlers_are_kept_up_to_the_bound() -> None:
    wraps: list[str] = []

    def wrap(method: str, handler: Handler) -> Handler:
        wraps.append(method)
        return handler

    generic = WrappedGeneric(_AnyMethod(), wrap)
    for _ in range(2):
        generic.service(_Details("/known/Method"))  # type: ignore[arg-type]
    assert wraps == ["/known/Method"]
    for i in range(MAX_CACHED_METHODS + 10):
        generic.service(_Details(f"/made/up{i}"))  # type: ignore[arg-type]
    wraps.clear()
    for _ in range(2):
        generic.service(_Details("/another/Path"))  # type: ignore[arg-type]
        generic.service(_Details("/known/Method"))  # type: ignore[arg-type]
    assert wraps == ["/another/Path", "/another/Path"]
