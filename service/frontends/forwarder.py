"""The gRPC handlers of a front-end's transports: which of its link's behaviors each method
gets (parent_link.py), within the host's bound on concurrent HTTP/2 calls."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

from service.frontends.descriptors import MODEL_INFER
from service.frontends.parent_link import ParentLink
from service.frontends.protocol import auth_of, opened_of
from service.frontends.stream_here import MODEL_STREAM_INFER


class Forwarder(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """Every method, whatever its kind, as a bidirectional stream of raw bytes: the wire
    format is the same, and the parent enforces what a unary method may receive. ModelInfer,
    the one most calls make, as the unary method it is: the transport reads its one message
    (and refuses a second, as the parent would), which costs less than a stream."""

    def __init__(self, link: ParentLink, transport: str) -> None:
        self._link = link
        self._transport = transport

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any]:
        method = handler_call_details.method
        link, transport = self._link, self._transport

        rpcs = link.h2_rpcs if transport == "h2" else None  # HTTP/3 counts its own

        def admitted(context: Any) -> AbstractAsyncContextManager[None]:
            return contextlib.nullcontext() if rpcs is None else rpcs.admitted(context)

        async def forward(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            async with (
                admitted(context),
                contextlib.aclosing(link.forward(method, transport, requests, context)) as answers,
            ):
                async for message in answers:
                    yield message

        async def infer(request: bytes, context: Any) -> bytes:
            async with admitted(context):
                return await link.infer(transport, request, context)

        async def stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            assert link.streams is not None
            opened = opened_of(method, transport, context, auth_of(context.auth_context()))
            async with (
                admitted(context),
                contextlib.aclosing(link.streams.responses(opened, requests, context)) as answers,
            ):
                async for message in answers:
                    yield message

        if method == MODEL_INFER:
            return grpc.unary_unary_rpc_method_handler(infer)
        if method == MODEL_STREAM_INFER and link.streams is not None:
            return grpc.stream_stream_rpc_method_handler(stream)
        return grpc.stream_stream_rpc_method_handler(forward)
