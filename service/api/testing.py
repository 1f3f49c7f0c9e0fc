"""paddlequic.v1.Testing: every RPC kind, statuses, metadata, delays and cancellation, so the
transport conformance suite can exercise both transports through the real server."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator

import grpc

from protos.paddlequic.v1 import testing_pb2 as pb
from protos.paddlequic.v1 import testing_pb2_grpc as pb_grpc
from service.inference.errors import ServicerContext


class TestingServicer(pb_grpc.TestingServicer):
    def __init__(self) -> None:
        self._cancelled: set[str] = set()
        self._executions: collections.Counter[str] = collections.Counter()

    async def Unary(self, request: pb.EchoRequest, context: ServicerContext) -> pb.EchoResponse:
        self._executions[request.token] += 1
        await self._prepare(request, context)
        return pb.EchoResponse(payload=request.payload)

    async def ServerStream(
        self, request: pb.EchoRequest, context: ServicerContext
    ) -> AsyncIterator[pb.EchoResponse]:
        await self._prepare(request, context)
        chunk = b"x" * request.response_size if request.response_size else request.payload
        for index in range(request.response_count):
            yield pb.EchoResponse(payload=chunk, index=index)

    async def ClientStream(
        self, request_iterator: AsyncIterator[pb.EchoRequest], context: ServicerContext
    ) -> pb.EchoResponse:
        total, count, last = 0, 0, pb.EchoRequest()
        async for request in request_iterator:
            total += len(request.payload)
            count += 1
            last = request
        await self._prepare(last, context)
        return pb.EchoResponse(total_bytes=total, messages=count)

    async def BidiStream(
        self, request_iterator: AsyncIterator[pb.EchoRequest], context: ServicerContext
    ) -> AsyncIterator[pb.EchoResponse]:
        index = 0
        async for request in request_iterator:
            await self._prepare(request, context)
            yield pb.EchoResponse(payload=request.payload, index=index)
            index += 1

    async def HandlerCancelled(
        self, request: pb.EchoRequest, context: ServicerContext
    ) -> pb.EchoResponse:
        return pb.EchoResponse(cancelled=request.token in self._cancelled)

    async def Executions(
        self, request: pb.EchoRequest, context: ServicerContext
    ) -> pb.EchoResponse:
        return pb.EchoResponse(messages=self._executions[request.token])

    async def PeerAuth(
        self, request: pb.EchoRequest, context: ServicerContext
    ) -> pb.PeerAuthResponse:
        return pb.PeerAuthResponse(
            identity_key=context.peer_identity_key() or "",
            identities=context.peer_identities() or (),
            properties=[
                pb.AuthProperty(name=name, values=values)
                for name, values in sorted(context.auth_context().items())
            ],
        )

    async def _prepare(self, request: pb.EchoRequest, context: ServicerContext) -> None:
        if request.echo_metadata:
            echoed = [(k, v) for k, v in context.invocation_metadata() or () if k.startswith("x-")]
            await context.send_initial_metadata(echoed)
            context.set_trailing_metadata(echoed)
        if request.sleep_seconds:
            try:
                await asyncio.sleep(request.sleep_seconds)
            except asyncio.CancelledError:
                if request.token:
                    self._cancelled.add(request.token)
                task = asyncio.current_task()
                if not request.outlive_cancel or task is None:
                    raise
                task.uncancel()
        if request.status_code:
            code = _CODES.get(request.status_code, grpc.StatusCode.UNKNOWN)
            await context.abort(code, request.status_message)
        if request.raise_error:
            raise RuntimeError(request.status_message or "raised by the handler")


_CODES = {code.value[0]: code for code in grpc.StatusCode}
