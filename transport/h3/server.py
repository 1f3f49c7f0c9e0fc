"""A gRPC server on HTTP/3 (aioquic) that drives the same grpc.RpcMethodHandlers as grpc.aio,
so `add_XServicer_to_server(servicer, server)` registers one servicer on both transports."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import NetworkAddress, QuicConnection

from transport.asgi import App
from transport.grpc.handler_table import HandlerTable
from transport.grpc.status import H3_NO_ERROR
from transport.h3 import udp
from transport.h3.address_tokens import AddressTokens, TokenVerdict
from transport.h3.admission import (
    RECEIVED,
    RECEIVED_COLUMN,
    RPCS,
    ConnectionAdmission,
    H3Limits,
)
from transport.h3.aioquic.client_auth import ClientAuth
from transport.h3.aioquic.connection_ids import tag_connection_ids
from transport.h3.aioquic.credit import NARROW_STREAM_WINDOW
from transport.h3.aioquic.quic_server import AdmittingQuicServer
from transport.h3.asgi import serve_plain_request
from transport.h3.calls import TransportAnswer, run_call
from transport.h3.datagram_routing import ROUTED_CID_LENGTH, DatagramRouter
from transport.h3.early_data import DEFAULT_EARLY_DATA_METHODS
from transport.h3.receive_budget import ReceiveBudget, SharedReceiveBudget
from transport.h3.server_connection import ServerConnection
from transport.h3.server_state import H3ServerStats
from transport.h3.settings import H3Settings
from transport.h3.stream import H3Stream
from transport.host_tally import ScopedTally
from transport.tls.session_tickets import TicketStore


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
        self._connections: set[ServerConnection] = set()
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
            return ServerConnection(quic, settings=self.settings, server=self)

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

    def publish_received(self, address: str) -> None:
        """What a stream's reservation or release changed (every stream has two): the bytes
        held, in all and for `address`, not every count."""
        host = self._host
        if host is not None:
            host.set(RECEIVED, self.receive_budget.budget.reserved_total)
            self.admission.publish_address(address, self.receive_budget.budget.held(address))

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

    def connection_opened(self, connection: ServerConnection) -> str:
        """Count the connection; returns the address it was admitted for."""
        self._connections.add(connection)
        self.stats.connections += 1
        address = self.admission.opened()
        self.publish(address)
        return address

    def handshake_finished(self) -> None:
        self.admission.handshake_finished()
        self.publish("")

    def connection_closed(self, connection: ServerConnection, unfinished: bool) -> None:
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

    def start_call(self, connection: ServerConnection, stream: H3Stream) -> None:
        self.stats.calls += 1
        task = asyncio.get_running_loop().create_task(self._serve(connection, stream))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _serve(self, connection: ServerConnection, stream: H3Stream) -> None:
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
        self._server.publish_received(address)
