"""The client end of a gRPC-over-HTTP/3 connection: connect, open request streams, learn of
GOAWAY and connection loss, including a server that went silent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Literal

import grpc
from aioquic.asyncio.client import connect
from aioquic.h3.connection import H3_ALPN
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicProtocolVersion
from aioquic.tls import SessionTicket

from transport.h3 import udp
from transport.h3.aioquic.connection import resend_early_data_after_retry
from transport.h3.aioquic.lean_handshake import offer_cheap_key_shares
from transport.h3.protocol import GrpcH3Protocol
from transport.h3.settings import H3Settings
from transport.h3.stream import H3Stream
from transport.h3.stream_state import StreamClosed

DEFAULT_UNRESPONSIVE_S = 10.0
# Silence, with calls in flight, after which a PING asks for an answer. It also bounds how
# long the server goes on sending to an address the client lost (a NAT rebinding, a move to
# another network) while calls wait for their responses: the client has nothing else to send,
# and its PING, from the new address, is what tells the server where the client is now.
PROBE_AFTER_S = 0.25


def probe_every(unresponsive_s: float) -> float:
    return min(PROBE_AFTER_S, unresponsive_s / 4)


def next_check_in(verdict: Literal["wait", "ping"], silent: float, unresponsive_s: float) -> float:
    """Seconds until the silence is looked at again: when it reaches the probe interval (a
    whole interval later would let it grow to nearly twice that before the PING), then every
    interval while it lasts."""
    probe = probe_every(unresponsive_s)
    return probe - silent if verdict == "wait" else probe


def liveness(
    now: float, heard_at: float, busy_since: float, unresponsive_s: float
) -> tuple[Literal["wait", "ping", "give up"], float]:
    """What the server's silence means at `now` (with the seconds it has lasted): only
    silence while calls are in flight counts, from the later of the last packet heard and the
    first call; a PING asks for an answer before the connection is given up."""
    silent = now - max(heard_at, busy_since)
    if silent >= unresponsive_s:
        return "give up", silent
    return ("ping" if silent >= probe_every(unresponsive_s) else "wait"), silent


class _ClientProtocol(GrpcH3Protocol):
    """A server process that died (SIGKILL, OOM) sends nothing more over UDP, and the process
    that may take its port over cannot tell the client either (aioquic clients ignore
    stateless resets). Without a check, calls on the connection would wait for their deadline
    and later ones join them until the idle timeout. So while calls are in flight, silence
    gets a PING, which a live server's QUIC stack acknowledges whatever its calls are doing;
    `unresponsive_s` of silence closes the connection: its calls fail UNAVAILABLE and the
    channel's next call connects anew."""

    def __init__(
        self,
        quic: QuicConnection,
        stream_handler: object = None,
        *,
        settings: H3Settings,
        unresponsive_s: float | None = DEFAULT_UNRESPONSIVE_S,
    ) -> None:
        super().__init__(quic, settings=settings)
        resend_early_data_after_retry(quic)
        offer_cheap_key_shares(quic)
        self.handshake: asyncio.Future[events.HandshakeCompleted] = (
            asyncio.get_running_loop().create_future()
        )
        self._unresponsive_s = unresponsive_s
        self._heard_at = self._loop.time()
        self._busy_since: float | None = None
        self._liveness: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        udp.enlarge_receive_buffer(transport.get_extra_info("socket"))
        # A connection moved to a new socket keeps its schedule: the silence it measures is
        # the connection's, and starting it again at each move would put off the PING (what
        # tells the server the new address) for as long as moves come faster than the probe
        # interval, with every call stalled meanwhile.
        if self._unresponsive_s and self._liveness is None:
            self._liveness = self._loop.call_later(self._probe_s, self._check_liveness)

    @property
    def _probe_s(self) -> float:
        assert self._unresponsive_s
        return probe_every(self._unresponsive_s)

    def datagram_received(self, data: bytes | str, addr: object) -> None:
        self._heard_at = self._loop.time()
        super().datagram_received(data, addr)

    def _check_liveness(self) -> None:
        if self.terminated is not None:
            return
        assert self._unresponsive_s
        now = self._loop.time()
        check_in = self._probe_s
        if not self.streams:
            self._busy_since = None
        else:
            if self._busy_since is None:
                self._busy_since = now
            verdict, silent = liveness(now, self._heard_at, self._busy_since, self._unresponsive_s)
            if verdict == "give up":
                self._give_up(f"no answer from the server for {silent:.1f} s")
                return
            if verdict == "ping":
                self._quic.send_ping(0)
                self.transmit()
            check_in = next_check_in(verdict, silent, self._unresponsive_s)
        self._liveness = self._loop.call_later(check_in, self._check_liveness)

    def _give_up(self, reason: str) -> None:
        """Fail the calls now (aioquic reports its own close only after a closing period)."""
        self._quic.close(reason_phrase=reason)
        self.transmit()
        self._terminated(
            events.ConnectionTerminated(error_code=0, frame_type=None, reason_phrase=reason)
        )

    def handshake_completed(self, event: events.HandshakeCompleted) -> None:
        if not self.handshake.done():
            self.handshake.set_result(event)

    def connection_lost_hook(self) -> None:
        if self._liveness is not None:
            self._liveness.cancel()
        if not self.handshake.done():
            assert self.terminated is not None
            self.handshake.set_exception(ConnectionError(self.terminated.message))

    def _goaway_received(self, stream_id: int) -> None:
        super()._goaway_received(stream_id)
        refused = StreamClosed(
            grpc.StatusCode.UNAVAILABLE,
            "the server is going away (GOAWAY) and did not process the call",
            refused=True,
        )
        for sid, stream in list(self.streams.items()):
            if sid >= stream_id:
                stream.fail(refused)

    def stop_sending_received(self, stream: H3Stream, error: StreamClosed) -> None:
        """The server refused the rest of the request (e.g. an oversized message): stop
        writing, and still read the status it answers with."""
        stream.stop_sending(error)

    def open_stream(self) -> H3Stream:
        stream_id = self._quic.get_next_available_stream_id()
        stream = H3Stream(self, stream_id)
        self.streams[stream_id] = stream
        return stream


class H3ClientConnection:
    """One QUIC connection carrying many calls; unusable once closed or told to go away."""

    def __init__(
        self, protocol: _ClientProtocol, stack: contextlib.AsyncExitStack, resuming: bool
    ) -> None:
        self.protocol = protocol
        self._stack = stack
        # A ticket that allows early data was offered: requests may go before the handshake.
        self.may_send_early = resuming
        self.sent_early = False
        self.ticket_received = asyncio.Event()

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        configuration: QuicConfiguration,
        settings: H3Settings | None = None,
        session_ticket_handler: Callable[[SessionTicket], None] | None = None,
        unresponsive_s: float | None = DEFAULT_UNRESPONSIVE_S,
        token_handler: Callable[[bytes], None] | None = None,
    ) -> H3ClientConnection:
        """Start the handshake without waiting for it, so the first request can ride along
        as 0-RTT early data when the configuration carries a session ticket. With calls in
        flight, `unresponsive_s` of silence from the server closes the connection (None: only
        the idle timeout does). `token_handler` gets the server's NEW_TOKEN tokens, for the
        configuration's `token` of a later connection."""
        chosen = settings or H3Settings()

        def create_protocol(quic: QuicConnection, stream_handler: object = None) -> Any:
            return _ClientProtocol(quic, settings=chosen, unresponsive_s=unresponsive_s)

        holder: list[H3ClientConnection] = []

        def ticket_arrived(ticket: SessionTicket) -> None:
            if session_ticket_handler is not None:
                session_ticket_handler(ticket)
            if holder:
                holder[0].ticket_received.set()

        stack = contextlib.AsyncExitStack()
        protocol = await stack.enter_async_context(
            connect(
                host,
                port,
                configuration=configuration,
                create_protocol=create_protocol,
                session_ticket_handler=ticket_arrived if session_ticket_handler else None,
                token_handler=token_handler,
                wait_connected=False,
            )
        )
        assert isinstance(protocol, _ClientProtocol)
        # After connect(): the H3 control streams must use the transport parameters that a
        # session ticket restored (aioquic reads them when the H3 connection is created).
        protocol.ensure_h3()
        # The first flight leaves at the end of this event-loop turn, not now: a first call
        # opened in the same turn (its request in 0-RTT early data) goes in the same transmit,
        # one pass of aioquic's packet builder for both datagrams, and the server reads them
        # in one turn.
        protocol.transmit_soon()
        ticket = configuration.session_ticket
        connection = cls(
            protocol, stack, ticket is not None and ticket.max_early_data_size is not None
        )
        holder.append(connection)
        return connection

    async def wait_connected(self) -> events.HandshakeCompleted:
        return await asyncio.shield(self.protocol.handshake)

    @property
    def handshake_succeeded(self) -> bool:
        handshake = self.protocol.handshake
        return handshake.done() and not handshake.cancelled() and handshake.exception() is None

    @property
    def usable(self) -> bool:
        return self.protocol.terminated is None and self.protocol.goaway_stream_id is None

    def open_stream(self) -> H3Stream:
        if self.protocol.terminated is not None:
            raise self.protocol.terminated
        if not self.protocol.handshake.done():
            self.sent_early = True
        return self.protocol.open_stream()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._stack.aclose(), 2.0)


def client_configuration(
    server_name: str,
    ca_file: str | None = None,
    session_ticket: SessionTicket | None = None,
    idle_timeout_s: float = 60.0,
    settings: H3Settings | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
    token: bytes = b"",
) -> QuicConfiguration:
    """`client_cert`/`client_key`: a certificate chain and key (PEM; the key may be in the
    chain file) offered when the server asks for one (mutual TLS). `token`: an address token
    the server sent on an earlier connection (NEW_TOKEN), which spares this one a Retry."""
    chosen = settings or H3Settings()
    configuration = QuicConfiguration(
        is_client=True,
        alpn_protocols=H3_ALPN,
        server_name=server_name,
        idle_timeout=idle_timeout_s,
        max_data=chosen.connection_window,
        max_stream_data=chosen.stream_window,
        max_datagram_size=chosen.max_datagram_size,
        # aioquic derives Initial keys for every version listed, on every connection; a
        # client starts with version 1 and has no use for the others' keys.
        supported_versions=[QuicProtocolVersion.VERSION_1],
    )
    if ca_file:
        configuration.load_verify_locations(cafile=ca_file)
    if client_cert:
        configuration.load_cert_chain(client_cert, client_key or None)
    configuration.session_ticket = session_ticket
    configuration.token = token
    return configuration
