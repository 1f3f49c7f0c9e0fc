"""One call on one HTTP/3 request stream, from its headers to its status: what the server runs
in a task per stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc.aio import AbortError

from transport.grpc import headers as wire
from transport.grpc.errors import ProtocolError
from transport.grpc.handler_table import HandlerTable, run_behavior
from transport.grpc.status import H3_NO_ERROR, H3_REQUEST_CANCELLED
from transport.h3 import early_data
from transport.h3.context import H3ServicerContext
from transport.h3.stream import H3Stream
from transport.h3.stream_state import StreamClosed
from transport.tls.peer_auth import PeerAuth

log = logging.getLogger("paddlequic.h3.server")

DEADLINE_EXCEEDED = (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ())


@dataclass(frozen=True)
class TransportAnswer:
    """A call the transport answered without its handler's behavior running (bad headers, an
    unknown method, the concurrency limit, a request message that never arrived whole or in
    time): what observation would otherwise never see."""

    method_path: str  # "" when the headers named none
    registered: bool  # method_path is a registered method (bounded, unlike any path)
    code: grpc.StatusCode
    details: str
    seconds: float


class CallServer(Protocol):
    """What a call uses of its server (`transport.h3.server.H3Server`)."""

    handlers: HandlerTable
    early_data_methods: frozenset[str]
    answered: Callable[[TransportAnswer], None] | None

    def count_handshake(self, kind: str) -> None: ...

    def rpc_room(self) -> bool:
        """Whether another handler may run (`--max-concurrent-rpcs`)."""
        ...

    def rpc_started(self) -> None: ...

    def rpc_ended(self) -> None: ...


class CallConnection(Protocol):
    """What a call uses of its connection (the server's `GrpcH3Protocol`)."""

    handshake_done: asyncio.Event
    terminated: StreamClosed | None

    def peer(self) -> str: ...

    def peer_auth(self) -> PeerAuth: ...

    def stop_receiving(self, stream_id: int, error_code: int = ...) -> None: ...

    def forget(self, stream_id: int) -> None: ...


async def run_call(server: CallServer, connection: CallConnection, stream: H3Stream) -> None:
    """Run the call `stream` carries: its headers, the handler they name, its status."""
    started = time.perf_counter()
    context: H3ServicerContext | None = None
    method = ""
    answer: tuple[grpc.StatusCode, str] | None = None  # what the transport answered
    try:
        headers = await stream.wait_headers()
        try:
            head = wire.parse_request_headers(headers)
        except ProtocolError as exc:
            block = (
                wire.error_response(exc.http_status)
                if exc.http_status
                else wire.trailers_only(exc.status, exc.message)
            )
            method = wire.request_path(headers)
            answer = exc.status, exc.message
            stream.send_headers(block, end=True)
            return
        method = head.method_path
        if stream.early and not early_data.allowed(head.method_path, server.early_data_methods):
            # Not idempotent: replayable early data must not run it. Hold it until the
            # handshake completes (a replayed handshake never does); it then runs once.
            server.count_handshake("early_requests_held")
            await connection.handshake_done.wait()
            if connection.terminated is not None:
                answer = connection.terminated.status, connection.terminated.message
                return
        handler = server.handlers.lookup(head.method_path, head.metadata)
        if handler is None:
            answer = grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {head.method_path}"
            stream.send_headers(wire.trailers_only(*answer), end=True)
            return
        if not server.rpc_room():
            answer = grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded"
            stream.send_headers(wire.trailers_only(*answer), end=True)
            return
        timeout = _remaining(head.timeout, stream)
        context = H3ServicerContext(
            stream,
            head.method_path,
            head.metadata,
            timeout,
            connection.peer(),
            handler.response_serializer,
            handler.request_deserializer,
            connection.peer_auth(),
        )
        server.rpc_started()
        code, details, trailing = await _drive(handler, context, stream, timeout)
        if not context.invoked:
            answer = code, details
        if stream.error is not None and stream.error.status == grpc.StatusCode.CANCELLED:
            return  # the client is gone; nobody reads an answer
        _end(stream, context, code, details, trailing)
    except StreamClosed:
        pass
    except asyncio.CancelledError:
        # Server stopping past its grace period: tell the client, then go.
        answer = grpc.StatusCode.UNAVAILABLE, "server shutting down"
        _end(stream, context, *answer)
        raise
    except Exception as exc:
        # A bug of ours, or a servicer context method that raised: the stream still ends.
        log.exception("call on stream %d failed", stream.stream_id)
        answer = grpc.StatusCode.INTERNAL, f"server error: {exc}"
        _end(stream, context, *answer)
    finally:
        if context is not None:
            server.rpc_ended()
            context.finish()
        if not stream.ended:
            # The call is over while the peer still sends: nobody will read it. After a
            # complete response that is no error (RFC 9114 4.1.2); otherwise the call was
            # cancelled.
            connection.stop_receiving(
                stream.stream_id, H3_NO_ERROR if stream.sent_end else H3_REQUEST_CANCELLED
            )
        connection.forget(stream.stream_id)
        if answer is not None and server.answered is not None and not (context and context.invoked):
            seconds = time.perf_counter() - started
            registered = server.handlers.registered(method)
            server.answered(TransportAnswer(method, registered, *answer, seconds))


def _remaining(timeout: float | None, stream: H3Stream) -> float | None:
    """The call's timeout counted from its headers' arrival, as the client counts it from
    their sending: the time the call then waited (for its task to run, for the handshake) is
    spent. Counted from later, the server's deadline trailed the client's by that wait, and
    the client's cancel at its deadline looked like a cancel well before the deadline."""
    if timeout is None:
        return None
    assert stream.headers_at is not None  # the call has its headers
    return max(0.0, timeout - (time.monotonic() - stream.headers_at))


def _end(
    stream: H3Stream,
    context: H3ServicerContext | None,
    code: grpc.StatusCode,
    details: str,
    trailing: tuple[tuple[str, str | bytes], ...] = (),
) -> None:
    """Send the status, unless the stream already ended or can no longer carry it.
    Trailing metadata the handler set that cannot be sent (invalid keys or values)
    turns the status into INTERNAL rather than leaving the stream open."""
    if stream.sent_end:
        return
    build = wire.trailers if context is not None and context.headers_sent else wire.trailers_only
    try:
        block = build(code, details, trailing)
    except ValueError as exc:
        block = build(grpc.StatusCode.INTERNAL, f"invalid trailing metadata: {exc}", ())
    with contextlib.suppress(Exception):  # the stream or the connection is gone
        stream.send_headers(block, end=True)


async def _drive(
    handler: grpc.RpcMethodHandler[Any, Any],
    context: H3ServicerContext,
    stream: H3Stream,
    timeout: float | None,
) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str | bytes], ...]]:
    # The handler runs in this call's own task (no task per call beyond it): a reset
    # from the peer cancels this task, and the deadline is a timeout around it.
    current = asyncio.current_task()
    assert current is not None

    def on_reset(error: StreamClosed) -> None:
        context.mark_cancelled()
        current.cancel()

    stream.on_reset = on_reset
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            await _invoke(handler, context, stream)
    except TimeoutError:
        context.mark_cancelled()
        return DEADLINE_EXCEEDED
    except AbortError:
        pass
    except StreamClosed as exc:
        return exc.status, exc.message, ()
    except asyncio.CancelledError:
        if stream.error is None or not context.cancelled():
            raise  # the server is stopping
        current.uncancel()
        return stream.error.status, stream.error.message, ()
    except Exception as exc:
        log.exception("unexpected error in %s", context.method_path)
        return grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}", ()
    finally:
        stream.on_reset = None
    if scope.expired():
        return DEADLINE_EXCEEDED  # a handler that outlived the deadline: its answer is late
    return context.final_status()


async def _invoke(
    handler: grpc.RpcMethodHandler[Any, Any], context: H3ServicerContext, stream: H3Stream
) -> None:
    """Call the handler as its kind requires and write what it returns."""
    request: Any
    if handler.request_streaming:
        request = context.request_iterator()
    else:  # the message first: until it is there, the transport answers for the call
        data = await stream.read_message()
        if data is None:
            raise StreamClosed(grpc.StatusCode.INTERNAL, "request ended without a message")
        if await stream.read_message() is not None:
            raise StreamClosed(
                grpc.StatusCode.INTERNAL, "received more than one message for a unary request"
            )
        request = _deserialize(handler, data)
    context.invoked = True
    await run_behavior(handler, request, context)


def _deserialize(handler: grpc.RpcMethodHandler[Any, Any], data: bytes) -> Any:
    if handler.request_deserializer is None:
        return data
    try:
        return handler.request_deserializer(data)
    except Exception as exc:
        raise StreamClosed(
            grpc.StatusCode.INVALID_ARGUMENT, f"failed to parse the request message: {exc}"
        ) from exc
