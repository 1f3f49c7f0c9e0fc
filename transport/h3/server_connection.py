"""One connection of the gRPC server on HTTP/3 (transport/h3/server.py): its handshake, the
streams it admits and refuses, and what it tells its server."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

import grpc
from aioquic.quic import events
from aioquic.quic.connection import NetworkAddress, QuicConnection
from aioquic.quic.packet import QuicErrorCode

from transport.asgi import App
from transport.grpc import headers as wire
from transport.grpc.status import H3_NO_ERROR, H3_REQUEST_REJECTED
from transport.h3.address_tokens import AddressTokens
from transport.h3.admission import H3Limits
from transport.h3.aioquic.client_auth import ClientAuth, request_client_certificates
from transport.h3.aioquic.connection import peer_address
from transport.h3.aioquic.early_tickets import issue_tickets_with_finished
from transport.h3.aioquic.lean_handshake import release_handshake_buffers
from transport.h3.aioquic.migration import resend_after_migration
from transport.h3.aioquic.new_token import send_new_token
from transport.h3.aioquic.tls_context import peer_certificate, refuse_early_data
from transport.h3.protocol import GrpcH3Protocol
from transport.h3.receive_budget import AddressShare, SharedReceiveBudget
from transport.h3.server_state import H3ServerStats
from transport.h3.settings import H3Settings
from transport.h3.stream import H3Stream
from transport.tls.peer_auth import PeerAuth
from transport.tls.session_tickets import TicketStore


class ConnectionServer(Protocol):
    """What a connection uses of its server (`transport.h3.server.H3Server`)."""

    zero_rtt: bool
    client_auth: ClientAuth | None
    tickets: TicketStore | None
    address_tokens: AddressTokens | None
    limits: H3Limits
    receive_budget: SharedReceiveBudget
    plain: App | None
    shutting_down: bool
    stats: H3ServerStats

    def issue_address_token(self, address: NetworkAddress) -> bytes: ...

    def connection_opened(self, connection: ServerConnection) -> str:
        """Count it; the address it was admitted for."""
        ...

    def handshake_finished(self) -> None: ...

    def connection_closed(self, connection: ServerConnection, unfinished: bool) -> None: ...

    def start_call(self, connection: ServerConnection, stream: H3Stream) -> None: ...

    def count_refusal(self, kind: str) -> None: ...

    def count_handshake(self, kind: str) -> None: ...


class ServerConnection(GrpcH3Protocol):
    """One connection of an H3Server: what it asks of TLS, its handshake's deadline, and
    which of its streams the server serves."""

    answers_malformed = True

    def __init__(
        self,
        quic: QuicConnection,
        stream_handler: object = None,
        *,
        settings: H3Settings,
        server: ConnectionServer,
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
        release_handshake_buffers(self._quic)
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
