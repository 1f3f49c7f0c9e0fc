"""A gRPC server on HTTP/3 (aioquic) that drives the same grpc.RpcMethodHandlers as grpc.aio,
so `add_XServicer_to_server(servicer, server)` registers one servicer on both transports."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from aioquic.h3.connection import H3_ALPN
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import NetworkAddress, QuicConnection
from aioquic.quic.packet import QuicErrorCode

from transport.asgi import App
from transport.grpc import headers as wire
from transport.grpc.handler_table import HandlerTable
from transport.grpc.status import H3_NO_ERROR, H3_REQUEST_REJECTED
from transport.h3 import udp
from transport.h3.address_tokens import AddressTokens, TokenVerdict
from transport.h3.admission import (
    RECEIVED,
    RECEIVED_COLUMN,
    RPCS,
    ConnectionAdmission,
    H3Limits,
)
from transport.h3.aioquic.client_auth import ClientAuth, request_client_certificates
from transport.h3.aioquic.connection import peer_address
from transport.h3.aioquic.connection_ids import tag_connection_ids
from transport.h3.aioquic.credit import NARROW_STREAM_WINDOW
from transport.h3.aioquic.early_tickets import issue_tickets_with_finished
from transport.h3.aioquic.migration import resend_after_migration
from transport.h3.aioquic.new_token import send_new_token
from transport.h3.aioquic.quic_server import AdmittingQuicServer
from transport.h3.aioquic.tls_context import peer_certificate, refuse_early_data
from transport.h3.asgi import serve_plain_request
from transport.h3.calls import TransportAnswer, run_call
from transport.h3.datagram_routing import ROUTED_CID_LENGTH, DatagramRouter
from transport.h3.early_data import DEFAULT_EARLY_DATA_METHODS
from transport.h3.protocol import GrpcH3Protocol
from transport.h3.receive_budget import AddressShare, ReceiveBudget, SharedReceiveBudget
from transport.h3.settings import H3Settings
from transport.h3.stream import H3Stream
from transport.host_tally import ScopedTally
from transport.tls.peer_auth import PeerAuth
from transport.tls.session_tickets import TicketStore


@dataclass
class H3ServerStats:
    connections: int = 0
    calls: int = 0
    rejected_streams: int = 0
    peak_send_buffered: int = 0
    # Also address tokens (transport/h3/address_tokens.py): "new_token_issued", and the
    # verdict on each one presented, "new_token_" + valid, expired, other_address, unreadable.
    handshakes: dict[str, int] = field(default_factory=dict)
    # "connections", "connections_per_address": new connections refused at a limit;
    # "handshake_timeout": dropped before completing the handshake; "metadata": streams
    # refused for a header block over the limit; "receive_budget": streams refused because
    # their address, or all addresses, reserved the whole receive budget (receive_budget.py);
    # "retry": Retry packets sent.
    refusals: dict[str, int] = field(default_factory=dict)


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
        resend_after_migration(quic)
        self.server = server
        # aioquic installs the 1-RTT keys and queues HandshakeCompleted together, so a request
        # seen before that event arrived as 0-RTT early data.
        self.handshake_done = asyncio.Event()
        self.highest_stream_id = -4
        if not server.zero_rtt:
            refuse_early_data(quic)
        if server.client_auth is not None:
            request_client_certificates(quic, server.client_auth)
        if server.tickets is not None:
            issue_tickets_with_finished(quic)
        if server.address_tokens is not None:
            send_new_token(quic, server.issue_address_token)
        self.address = server.connection_opened(self)
        self.credit.use_budget(
            AddressShare(server.receive_budget, self.address), self.transmit_soon
        )
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
        block = wire.trailers_only(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        if self.server.plain is not None:
            # REST is served here too, and the block was dropped unread: whichever the request
            # was, it reads its refusal, REST from the HTTP status (431), gRPC from grpc-status
            # (which a Trailers-Only answer's reader takes first).
            block = [(b":status", b"431"), *(f for f in block if f[0] != b":status")]
        with contextlib.suppress(Exception):
            self.h3_send_headers(stream_id, block, True)

    def stream_opened(self, stream_id: int) -> H3Stream | None:
        if self.server.shutting_down or (
            self.goaway_sent is not None and stream_id >= self.goaway_sent
        ):
            self.server.stats.rejected_streams += 1
            self.reset(stream_id, H3_REQUEST_REJECTED)
            return None
        if not self.credit.admit(stream_id):
            self.server.count_refusal("receive_budget")
            limits = self.server.limits
            self.stop_receiving(stream_id, H3_NO_ERROR)  # the status below is a complete response
            message = (
                "receive budget exhausted: the streams of one address may hold "
                f"{limits.receive_budget_per_address} bytes not yet read, of all addresses "
                f"{limits.receive_budget_total}; retry later"
            )
            with contextlib.suppress(Exception):
                self.h3_send_headers(
                    stream_id, wire.trailers_only(grpc.StatusCode.RESOURCE_EXHAUSTED, message), True
                )
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
        if not self.handshake_done.is_set():
            self.handshake_done.set()
            self.server.handshake_finished()
        self._handshake_timer.cancel()
        if event.early_data_accepted:
            self.server.count_handshake("0rtt_accepted")
        else:
            self.server.count_handshake("resumed" if event.session_resumed else "full")

    def connection_lost_hook(self) -> None:
        self.server.connection_closed(self, unfinished=not self.handshake_done.is_set())
        self.handshake_done.set()  # wakes calls held for it; their streams have failed
        self._handshake_timer.cancel()

    def client(self) -> tuple[str, int] | None:
        address = peer_address(self._quic)
        return None if address is None else (str(address[0]), int(address[1]))

    def early_request_held(self) -> None:
        self.server.count_handshake("early_requests_held")

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
        address_tokens: AddressTokens | None = None,
        plain: App | None = None,
        host: ScopedTally | None = None,
    ) -> None:
        """`tickets` enables session resumption; with `zero_rtt` resumed clients may also send
        early data, of which only `early_data_methods` run before the handshake completes.
        `client_auth`: ask clients for certificates (mutual TLS). Past `max_concurrent_rpcs`
        handlers running at once (None: no limit), calls are refused with RESOURCE_EXHAUSTED,
        as grpc.aio's `maximum_concurrent_rpcs` does. `router`: this server shares its port
        with other processes and passes them the datagrams of their connections.
        `address_tokens`: send each client a NEW_TOKEN token and take it back in place of a
        Retry (None: neither). `plain`: the ASGI app that serves requests that are not gRPC
        (their content-type says so) on the same connections (None: they are refused)."""
        self.settings = settings or H3Settings()
        self.tickets = tickets
        self.zero_rtt = zero_rtt
        self.early_data_methods = early_data_methods
        self._idle_timeout_s = idle_timeout_s
        self.client_auth = client_auth
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.active_rpcs = 0  # handlers running now (counted by `run_call`)
        self.limits = limits or H3Limits()
        self.router = router
        self.address_tokens = address_tokens
        self.plain = plain
        self._host = host
        self.admission = ConnectionAdmission(self.limits, host, self.count_refusal)
        self.receive_budget = SharedReceiveBudget(
            ReceiveBudget(self.limits.receive_budget_total, self.limits.receive_budget_per_address),
            None if host is None else _ReceivedElsewhere(self, host),
        )
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
            # Request streams get their full window once the receive budget reserved it.
            max_stream_data=min(NARROW_STREAM_WINDOW, self.settings.stream_window),
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
                admit=self.admission.decide,
                address_token=self._address_token_valid if self.address_tokens else None,
                queued=lambda: udp.queued(sock, udp.MAX_BURST - 1),
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

    def issue_address_token(self, address: NetworkAddress) -> bytes:
        assert self.address_tokens is not None
        self.count_handshake("new_token_issued")
        return self.address_tokens.issue(str(address[0]))

    def _address_token_valid(self, token: bytes, address: NetworkAddress) -> bool:
        assert self.address_tokens is not None
        verdict = self.address_tokens.check(token, str(address[0]))
        self.count_handshake(f"new_token_{verdict.value}")
        return verdict is TokenVerdict.VALID

    def publish(self, address: str) -> None:
        """What this process holds, where the others on the port read it: its connections,
        unfinished handshakes, handlers and received bytes, and the address's connections
        and bytes ("": no address changed)."""
        host = self._host
        if host is None:
            return
        host.set(RPCS, self.active_rpcs)
        host.set(RECEIVED, self.receive_budget.budget.reserved_total)
        self.admission.publish(address, self.receive_budget.budget.held(address) if address else 0)

    def rpc_room(self) -> bool:
        limit = self.max_concurrent_rpcs
        if limit is None:
            return True
        elsewhere = 0 if self._host is None else self._host.others(RPCS)
        return self.active_rpcs + elsewhere < limit

    def rpc_started(self) -> None:
        self.active_rpcs += 1
        if self._host is not None:
            self._host.set(RPCS, self.active_rpcs)

    def rpc_ended(self) -> None:
        self.active_rpcs -= 1
        if self._host is not None:
            self._host.set(RPCS, self.active_rpcs)

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
        address = self.admission.opened()
        self.publish(address)
        return address

    def handshake_finished(self) -> None:
        self.admission.handshake_finished()
        self.publish("")

    def connection_closed(self, connection: _ServerProtocol, unfinished: bool) -> None:
        """`unfinished`: it never completed its handshake."""
        if connection in self._connections:
            self._connections.discard(connection)
            self.admission.closed(connection.address, unfinished)
            self.publish(connection.address)
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
        task = asyncio.get_running_loop().create_task(self._serve(connection, stream))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _serve(self, connection: _ServerProtocol, stream: H3Stream) -> None:
        """The stream, routed by its request: gRPC, or a plain HTTP request for `plain`. Its
        header block arrived with the event that opened it, so it is here when this runs."""
        if self.plain is not None and stream.headers is not None and stream.state.plain:
            await serve_plain_request(self.plain, stream, connection)
        else:
            await run_call(self, connection, stream)


class _ReceivedElsewhere:
    """The receive budget's view of the other processes on the port (receive_budget.py)."""

    def __init__(self, server: H3Server, host: ScopedTally) -> None:
        self._server = server
        self._host = host

    def held(self, address: str) -> tuple[int, int]:
        return self._host.others_at(address)[RECEIVED_COLUMN], self._host.others(RECEIVED)

    def publish(self, address: str) -> None:
        self._server.publish(address)
