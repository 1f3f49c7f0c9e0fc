"""A gRPC server on HTTP/3 (aioquic) that drives the same grpc.RpcMethodHandlers as grpc.aio,
so `add_XServicer_to_server(servicer, server)` registers one servicer on both transports."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import grpc
from aioquic.h3.connection import H3_ALPN
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import NetworkAddress, QuicConnection
from aioquic.quic.packet import QuicErrorCode
from grpc.aio import AbortError

from transport.grpc import headers as wire
from transport.grpc.errors import ProtocolError
from transport.grpc.handler_table import HandlerTable, run_behavior
from transport.grpc.status import H3_NO_ERROR, H3_REQUEST_CANCELLED, H3_REQUEST_REJECTED
from transport.h3 import early_data, udp
from transport.h3.aioquic.client_auth import ClientAuth, request_client_certificates
from transport.h3.aioquic.internals import (
    Admission,
    AdmittingQuicServer,
    peer_address,
    peer_certificate,
    refuse_early_data,
    tag_connection_ids,
)
from transport.h3.context import H3ServicerContext
from transport.h3.datagram_routing import ROUTED_CID_LENGTH, DatagramRouter
from transport.h3.early_data import DEFAULT_EARLY_DATA_METHODS
from transport.h3.protocol import GrpcH3Protocol, H3Settings, H3Stream, StreamClosed
from transport.tls.peer_auth import PeerAuth
from transport.tls.session_tickets import TicketStore

log = logging.getLogger("paddlequic.h3.server")

DEADLINE_EXCEEDED = (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ())


@dataclass
class H3ServerStats:
    connections: int = 0
    calls: int = 0
    rejected_streams: int = 0
    peak_send_buffered: int = 0
    handshakes: dict[str, int] = field(default_factory=dict)
    # "connections", "connections_per_address": new connections refused at a limit;
    # "handshake_timeout": dropped before completing the handshake; "metadata": streams
    # refused for a header block over the limit; "retry": Retry packets sent.
    refusals: dict[str, int] = field(default_factory=dict)


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


class RetryMode(Enum):
    """When a new connection must first prove its address with a QUIC Retry (one more round
    trip): `auto` only while many connections are half-open (a flood of Initials, possibly
    from spoofed addresses)."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


@dataclass(frozen=True)
class H3Limits:
    """What one server holds for connections it did not choose: all bounded."""

    max_connections: int = 1024
    max_connections_per_address: int = 64
    handshake_timeout_s: float = 10.0
    retry: RetryMode = RetryMode.AUTO
    retry_above_half_open: int = 64  # auto: Retry while this many handshakes are unfinished


class _ServerProtocol(GrpcH3Protocol):
    answers_malformed = True

    def __init__(
        self,
        quic: QuicConnection,
        stream_handler: object = None,
        *,
        settings: H3Settings,
        server: H3Server,
    ) -> None:
        super().__init__(quic, settings=settings)
        self.server = server
        # aioquic installs the 1-RTT keys and queues HandshakeCompleted together, so a request
        # seen before that event arrived as 0-RTT early data.
        self.handshake_done = asyncio.Event()
        self.highest_stream_id = -4
        if not server.zero_rtt:
            refuse_early_data(quic)
        if server.client_auth is not None:
            request_client_certificates(quic, server.client_auth)
        self.address = server.connection_opened(self)
        self._handshake_timer = self._loop.call_later(
            server.limits.handshake_timeout_s, self._handshake_expired
        )

    def _handshake_expired(self) -> None:
        """Drop a connection that never completed its handshake: a peer that only sends
        Initials must not hold state for the whole idle timeout."""
        if not self.handshake_done.is_set() and self.terminated is None:
            self.server.count_refusal("handshake_timeout")
            self._quic.close(
                error_code=QuicErrorCode.CONNECTION_REFUSED, reason_phrase="handshake timeout"
            )
            self.transmit_soon()

    def header_block_refused(self, stream_id: int, message: str) -> None:
        self.server.count_refusal("metadata")
        self.stop_receiving(stream_id, H3_NO_ERROR)  # the status below is a complete response
        with contextlib.suppress(Exception):
            self.h3_send_headers(
                stream_id, wire.trailers_only(grpc.StatusCode.RESOURCE_EXHAUSTED, message), True
            )

    def stream_opened(self, stream_id: int) -> H3Stream | None:
        if self.server.shutting_down or (
            self.goaway_sent is not None and stream_id >= self.goaway_sent
        ):
            self.server.stats.rejected_streams += 1
            self.reset(stream_id, H3_REQUEST_REJECTED)
            return None
        stream = H3Stream(self, stream_id)
        stream.early = not self.handshake_done.is_set()
        self.streams[stream_id] = stream
        self.highest_stream_id = max(self.highest_stream_id, stream_id)
        self.server.start_call(self, stream)
        return stream

    goaway_sent: int | None = None

    def send_goaway(self) -> None:
        if self.goaway_sent is None and self.terminated is None:
            self.goaway_sent = self.highest_stream_id + 4
            self.ensure_h3().send_goaway(self.goaway_sent)
            self.transmit_soon()

    def handshake_completed(self, event: events.HandshakeCompleted) -> None:
        self.handshake_done.set()
        self._handshake_timer.cancel()
        if event.early_data_accepted:
            self.server.count_handshake("0rtt_accepted")
        else:
            self.server.count_handshake("resumed" if event.session_resumed else "full")

    def connection_lost_hook(self) -> None:
        self.handshake_done.set()  # wakes calls held for it; their streams have failed
        self._handshake_timer.cancel()
        self.server.connection_closed(self)

    def peer_auth(self) -> PeerAuth:
        return PeerAuth(peer_certificate(self._quic), self._quic.tls.session_resumed)

    def peer(self) -> str:
        address = peer_address(self._quic)
        if address is None:
            return "unknown"
        host, port = address[:2]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


class H3Server:
    def __init__(
        self,
        settings: H3Settings | None = None,
        tickets: TicketStore | None = None,
        zero_rtt: bool = True,
        early_data_methods: frozenset[str] = DEFAULT_EARLY_DATA_METHODS,
        idle_timeout_s: float = 60.0,
        client_auth: ClientAuth | None = None,
        max_concurrent_rpcs: int | None = None,
        limits: H3Limits | None = None,
        router: DatagramRouter | None = None,
    ) -> None:
        """`tickets` enables session resumption; with `zero_rtt` resumed clients may also send
        early data, of which only `early_data_methods` run before the handshake completes.
        `client_auth`: ask clients for certificates (mutual TLS). Past `max_concurrent_rpcs`
        handlers running at once (None: no limit), calls are refused with RESOURCE_EXHAUSTED,
        as grpc.aio's `maximum_concurrent_rpcs` does. `router`: this server shares its port
        with other processes and passes them the datagrams of their connections."""
        self.settings = settings or H3Settings()
        self.tickets = tickets
        self.zero_rtt = zero_rtt
        self.early_data_methods = early_data_methods
        self._idle_timeout_s = idle_timeout_s
        self.client_auth = client_auth
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self._active_rpcs = 0
        self.limits = limits or H3Limits()
        self.router = router
        self._per_address: Counter[str] = Counter()
        self._admitted: str = ""  # the address of the connection being created
        self.handlers = HandlerTable()
        self._connections: set[_ServerProtocol] = set()
        self._calls: set[asyncio.Task[None]] = set()
        self._quic_server: AdmittingQuicServer | None = None
        self.shutting_down = False
        self.stats = H3ServerStats()
        self.answered: Callable[[TransportAnswer], None] | None = None  # see TransportAnswer

    # grpc.aio.Server's registration API

    def add_generic_rpc_handlers(
        self, handlers: Iterable[grpc.GenericRpcHandler[Any, Any]]
    ) -> None:
        self.handlers.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self.handlers.add_registered_method_handlers(service_name, method_handlers)

    # life cycle

    async def start(
        self, host: str, port: int, certfile: Path, keyfile: Path, reuse_port: bool = False
    ) -> int:
        """Listen on UDP; returns the bound port. `reuse_port`: share it with other processes
        (SO_REUSEPORT)."""
        configuration = QuicConfiguration(
            is_client=False,
            alpn_protocols=H3_ALPN,
            idle_timeout=self._idle_timeout_s,
            max_data=self.settings.connection_window,
            max_stream_data=self.settings.stream_window,
            max_datagram_size=self.settings.max_datagram_size,
        )
        configuration.load_cert_chain(certfile, keyfile)
        if self.router is not None:
            configuration.connection_id_length = ROUTED_CID_LENGTH
            tag_connection_ids(self.router.index, ROUTED_CID_LENGTH)

        def create_protocol(quic: QuicConnection, stream_handler: object = None) -> Any:
            return _ServerProtocol(quic, settings=self.settings, server=self)

        sock = udp.bind(host, port, reuse_port)
        _, self._quic_server = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: AdmittingQuicServer(
                admit=self._admit,
                sock=sock,
                steer=self.router.steer if self.router is not None else None,
                configuration=configuration,
                create_protocol=create_protocol,
                session_ticket_fetcher=self.tickets.pop if self.tickets is not None else None,
                session_ticket_handler=self.tickets.add if self.tickets is not None else None,
            ),
            sock=sock,
        )
        if self.router is not None:
            self.router.start(self._quic_server.receive_forwarded)
        return self._quic_server.port

    def _admit(self, address: NetworkAddress, has_token: bool) -> Admission:
        """Decide on a new connection before any state exists for it."""
        host = str(address[0])
        limits = self.limits
        if len(self._connections) >= limits.max_connections:
            self.count_refusal("connections")
            return Admission.REFUSE
        if self._per_address[host] >= limits.max_connections_per_address:
            self.count_refusal("connections_per_address")
            return Admission.REFUSE
        if not has_token and (
            limits.retry is RetryMode.ALWAYS
            or (limits.retry is RetryMode.AUTO and self.half_open() >= limits.retry_above_half_open)
        ):
            self.count_refusal("retry")
            return Admission.RETRY
        self._admitted = host
        return Admission.ACCEPT

    def half_open(self) -> int:
        """Connections whose handshake has not completed."""
        return sum(not c.handshake_done.is_set() for c in self._connections)

    async def stop(self, grace: float | None) -> None:
        """GOAWAY, refuse new streams, let in-flight calls finish within `grace`, close."""
        self.shutting_down = True
        for connection in list(self._connections):
            connection.send_goaway()
        if self._calls and grace:
            await asyncio.wait(set(self._calls), timeout=grace)
        for task in list(self._calls):
            task.cancel()
        if self._calls:
            await asyncio.wait(set(self._calls), timeout=1.0)
        for connection in list(self._connections):
            connection.close(error_code=H3_NO_ERROR, reason_phrase="server shutting down")
        await asyncio.sleep(0)
        if self._quic_server is not None:
            self._quic_server.close()
            self._quic_server = None
        if self.router is not None:
            self.router.close()

    def connection_opened(self, connection: _ServerProtocol) -> str:
        """Count the connection; returns the address it was admitted for."""
        self._connections.add(connection)
        self.stats.connections += 1
        host, self._admitted = self._admitted, ""
        self._per_address[host] += 1
        return host

    def connection_closed(self, connection: _ServerProtocol) -> None:
        if connection in self._connections:
            self._connections.discard(connection)
            self._per_address[connection.address] -= 1
            if not self._per_address[connection.address]:
                del self._per_address[connection.address]
        self.stats.peak_send_buffered = max(
            self.stats.peak_send_buffered, connection.peak_send_buffered
        )

    def count_refusal(self, kind: str) -> None:
        self.stats.refusals[kind] = self.stats.refusals.get(kind, 0) + 1

    def count_handshake(self, kind: str) -> None:
        self.stats.handshakes[kind] = self.stats.handshakes.get(kind, 0) + 1

    def blocked_writers(self) -> int:
        return sum(c.blocked_writers for c in self._connections)

    def peak_send_buffered(self) -> int:
        """The most bytes any stream held unacknowledged: bounded by flow control."""
        return max(
            [self.stats.peak_send_buffered, *(c.peak_send_buffered for c in self._connections)]
        )

    # calls

    def start_call(self, connection: _ServerProtocol, stream: H3Stream) -> None:
        self.stats.calls += 1
        task = asyncio.get_running_loop().create_task(self._run_call(connection, stream))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _run_call(self, connection: _ServerProtocol, stream: H3Stream) -> None:
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
            if stream.early and not early_data.allowed(head.method_path, self.early_data_methods):
                # Not idempotent: replayable early data must not run it. Hold it until the
                # handshake completes (a replayed handshake never does); it then runs once.
                self.count_handshake("early_requests_held")
                await connection.handshake_done.wait()
                if connection.terminated is not None:
                    answer = connection.terminated.status, connection.terminated.message
                    return
            handler = self.handlers.lookup(head.method_path, head.metadata)
            if handler is None:
                answer = grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {head.method_path}"
                stream.send_headers(wire.trailers_only(*answer), end=True)
                return
            if (
                self.max_concurrent_rpcs is not None
                and self._active_rpcs >= self.max_concurrent_rpcs
            ):
                answer = grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded"
                stream.send_headers(wire.trailers_only(*answer), end=True)
                return
            context = H3ServicerContext(
                stream,
                head.method_path,
                head.metadata,
                head.timeout,
                connection.peer(),
                handler.response_serializer,
                handler.request_deserializer,
                connection.peer_auth(),
            )
            self._active_rpcs += 1
            code, details, trailing = await self._drive(handler, context, stream, head.timeout)
            if not context.invoked:
                answer = code, details
            if stream.error is not None and stream.error.status == grpc.StatusCode.CANCELLED:
                return  # the client is gone; nobody reads an answer
            self._end(stream, context, code, details, trailing)
        except StreamClosed:
            pass
        except asyncio.CancelledError:
            # Server stopping past its grace period: tell the client, then go.
            answer = grpc.StatusCode.UNAVAILABLE, "server shutting down"
            self._end(stream, context, *answer)
            raise
        except Exception as exc:
            # A bug of ours, or a servicer context method that raised: the stream still ends.
            log.exception("call on stream %d failed", stream.stream_id)
            answer = grpc.StatusCode.INTERNAL, f"server error: {exc}"
            self._end(stream, context, *answer)
        finally:
            if context is not None:
                self._active_rpcs -= 1
                context.finish()
            if not stream.ended:
                # The call is over while the peer still sends: nobody will read it. After a
                # complete response that is no error (RFC 9114 4.1.2); otherwise the call was
                # cancelled.
                connection.stop_receiving(
                    stream.stream_id, H3_NO_ERROR if stream.sent_end else H3_REQUEST_CANCELLED
                )
            connection.forget(stream.stream_id)
            if (
                answer is not None
                and self.answered is not None
                and not (context and context.invoked)
            ):
                seconds = time.perf_counter() - started
                registered = self.handlers.registered(method)
                self.answered(TransportAnswer(method, registered, *answer, seconds))

    @staticmethod
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
        build = (
            wire.trailers if context is not None and context.headers_sent else wire.trailers_only
        )
        try:
            block = build(code, details, trailing)
        except ValueError as exc:
            block = build(grpc.StatusCode.INTERNAL, f"invalid trailing metadata: {exc}", ())
        with contextlib.suppress(Exception):  # the stream or the connection is gone
            stream.send_headers(block, end=True)

    async def _drive(
        self,
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
