"""One handler of each kind (unary-unary, unary-stream, stream-unary, stream-stream), for the
unit tests of the wrapping servers (restricted protocols, observation, request parsing): each
records the requests it saw, so a test can tell whether a behavior ran, served by a real
server of either transport (grpc.aio; the HTTP/3 server, which has no interceptors) on a real
socket and called by a real channel (grpc.aio; QuicChannel)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from clients.quic_channel import QuicChannel
from protos.paddlequic.v1 import testing_pb2 as pb
from transport.grpc.wrapping import HANDLER_BUILDERS, Handler
from transport.h3.server import H3Server
from transport.tls.certs import ensure_dev_certificates

Request = pb.EchoRequest
Response = pb.EchoResponse
KINDS = {
    "Unary": (False, False),
    "ServerStream": (False, True),
    "ClientStream": (True, False),
    "BidiStream": (True, True),
}
REQUESTS = [Request(payload=bytes([i])) for i in range(3)]


def refused_requests(method: str) -> list[bytes]:
    """What a call expected to be refused before its behavior starts sends (see `call`)."""
    return [] if KINDS[method][0] else [REQUESTS[0].SerializeToString()]


TIMEOUT_S = 30.0


class Recorder:
    """Which behaviors started, and what each saw: the method's name once per request it
    read (a unary one: once when it ran)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.seen: list[tuple[str, Any]] = []

    def handlers(
        self, deserializer: Callable[[bytes], Any] = Request.FromString
    ) -> dict[str, Handler]:
        """Each behavior answers with one EchoResponse per request it read (a unary
        request is answered twice when the responses stream)."""
        seen, started = self.seen, self.started

        async def unary(request: Any, context: Any) -> Response:
            started.append("Unary")
            seen.append(("Unary", request))
            return Response(messages=1)

        async def server_stream(request: Any, context: Any) -> AsyncIterator[Response]:
            started.append("ServerStream")
            seen.append(("ServerStream", request))
            for index in range(2):
                yield Response(index=index)

        async def client_stream(requests: AsyncIterator[Any], context: Any) -> Response:
            started.append("ClientStream")
            count = 0
            async for request in requests:
                seen.append(("ClientStream", request))
                count += 1
            return Response(messages=count)

        async def bidi_stream(
            requests: AsyncIterator[Any], context: Any
        ) -> AsyncIterator[Response]:
            started.append("BidiStream")
            async for request in requests:
                seen.append(("BidiStream", request))
                yield Response(messages=1)

        behaviors = (unary, server_stream, client_stream, bidi_stream)
        return handlers_of(behaviors, deserializer, Response.SerializeToString)

    def ran(self, method: str) -> bool:
        return any(name == method for name, _ in self.seen)


def handlers_of(
    behaviors: Sequence[Callable[..., Any]],
    deserializer: Callable[[bytes], Any],
    serializer: Callable[[Any], bytes],
) -> dict[str, Handler]:
    """One handler of each kind, from its behavior (in the order of KINDS)."""
    return {
        name: HANDLER_BUILDERS[KINDS[name]](
            behavior, request_deserializer=deserializer, response_serializer=serializer
        )
        for name, behavior in zip(KINDS, behaviors, strict=True)
    }


TRANSPORTS = ("h2", "h3")


@contextlib.asynccontextmanager
async def serving(
    register: Callable[[Any], None],
    transport: str = "h2",
    certs: Path | None = None,
    h2_options: Sequence[tuple[str, Any]] = (),
) -> AsyncIterator[Any]:
    """A server of `transport` on a free port with what `register` put on it (grpc.aio, or
    the HTTP/3 server with development certificates in `certs`), and a channel to it (a
    grpc.aio one with `h2_options`)."""
    if transport == "h3":
        assert certs is not None
        dev, _ = ensure_dev_certificates(certs)
        h3 = H3Server()
        register(h3)
        port = await h3.start("127.0.0.1", 0, dev.server_cert, dev.server_key)
        try:
            async with QuicChannel(f"localhost:{port}", ca_file=str(dev.ca_cert)) as quic:
                yield quic
        finally:
            await h3.stop(None)
        return
    server = grpc.aio.server()
    register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", h2_options) as channel:
            yield channel
    finally:
        await server.stop(None)


async def call(
    channel: Any,
    service: str,
    method: str,
    metadata: Sequence[tuple[str, str]] = (),
    requests: Sequence[bytes] | None = None,
) -> tuple[grpc.StatusCode, list[Any]]:
    """One call of `method`'s kind with `requests` (serialized; default REQUESTS, a unary
    call sends the first): its status and the responses it got. A call the server ends
    while the client still writes may end INTERNAL on the client's side (grpc.aio's write
    fails: "Internal error from Core"), so a stream expected to be refused before it is read
    sends no message, only its half-close."""
    path = f"/{service}/{method}"
    sent = [r.SerializeToString() for r in REQUESTS] if requests is None else list(requests)
    request_streaming, response_streaming = KINDS[method]
    factory: Callable[..., Any] = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[request_streaming, response_streaming]
    multicallable: Any = factory(path, response_deserializer=Response.FromString)

    if not request_streaming:
        rpc = multicallable(sent[0], metadata=metadata, timeout=TIMEOUT_S)
    else:
        rpc = multicallable(metadata=metadata, timeout=TIMEOUT_S)
        with contextlib.suppress(grpc.aio.AioRpcError):
            for request in sent:
                await rpc.write(request)
            await rpc.done_writing()
    responses: list[Any] = []
    with contextlib.suppress(grpc.aio.AioRpcError):
        responses = [r async for r in rpc] if response_streaming else [await rpc]
    return await rpc.code(), responses
