"""Every use of aioquic's private internals, in one place.

aioquic offers no hooks for what gRPC over HTTP/3 needs on an untrusted network: receive
credit that follows what the application consumed, GOAWAY, a bound on header blocks,
connection admission (limits, Retry on demand), refusing early data per connection; nor for
what saves packets on small calls: ACKs riding with stream data, QPACK without a dynamic table.
So this module replaces or reads private methods and attributes, read from aioquic 1.7.2, and
refuses to load with any other version: a silent mismatch would corrupt flow control.

Besides these, subclasses of aioquic's `QuicConnectionProtocol` use its `_quic`, `_loop`,
`_process_events` and `_transmit_soon` members, as aioquic's own examples do.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import socket
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, cast

import pylsqpack
from aioquic import tls
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer, encode_uint_var  # type: ignore[attr-defined]
from aioquic.h3.connection import FrameType, H3Connection, Setting, encode_frame
from aioquic.h3.events import H3Event, HeadersReceived
from aioquic.quic import connection as connection_module
from aioquic.quic import events
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE
from aioquic.quic.connection import (
    CONNECTION_LIMIT_FRAME_CAPACITY,
    MAX_STREAM_DATA_FRAME_CAPACITY,
    TRANSPORT_CLOSE_FRAME_CAPACITY,
    NetworkAddress,
    QuicConnection,
)
from aioquic.quic.crypto import CryptoPair
from aioquic.quic.packet import (
    QuicErrorCode,
    QuicFrameType,
    QuicPacketType,
    pull_quic_header,
)
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.stream import QuicStream
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from transport.grpc.headers import field_section_size
from transport.h3 import udp
from transport.h3.goaway import GoawayReader

PINNED_VERSION = "1.7.2"


def check_version(installed: str) -> None:
    """Raise unless `installed` is the aioquic version this module was written against."""
    if installed != PINNED_VERSION:
        raise ImportError(
            f"paddlequic's HTTP/3 transport needs aioquic=={PINNED_VERSION} exactly (it relies "
            f"on that version's internals); aioquic {installed} is installed"
        )


check_version(importlib.metadata.version("aioquic"))

DEFAULT_STREAM_WINDOW = 1 << 20
DEFAULT_CONNECTION_WINDOW = 16 << 20
# Credit beyond a message in progress, for the HTTP/3 framing around its payload (a DATA frame
# header is at most 9 bytes) and a few frames more: what lets the peer finish the message,
# however it frames it.
FRAMING_SLACK = 16 << 10
_PRUNE_STOPPED = 64


def credit_limit(
    limit: int, received: int, held: int, window: int, batch: int, reader_waits: bool
) -> int:
    """The credit limit to announce: `limit` (the last one) or a new, higher one.

    The target is what the application consumed (`received` minus the `held` bytes nobody
    took yet) plus `window`. It is granted once it moved by `batch` (few, large updates), or
    when the peer has less than `FRAMING_SLACK` left while the reader waits for more (it holds
    nothing it could take: a partial message at most). The second rule guarantees progress:
    a blocked peer has nothing left (`limit == received`), and a waiting reader with a window
    that covers the message in progress plus `FRAMING_SLACK` makes the target exceed the
    limit, so new credit goes out with the next packet however the message was framed."""
    target = received - held + window
    if target > limit and (
        target - limit >= batch or (reader_waits and limit - received < FRAMING_SLACK)
    ):
        return target
    return limit


class ReceiveCredit:
    """Credit = bytes the application consumed + window, per request stream and in total.

    aioquic grants the peer more credit as soon as data arrives, whether or not anybody read
    it. Here every byte the stream holds counts: messages queued for the application, a
    partial message in the decoder, a partial header block in the H3 layer. A stopped stream
    (nobody reads it any more) gets no more stream credit; what arrives on it is discarded
    and so frees connection credit.

    A message can only be consumed whole, so a message larger than a window would never
    complete, nor would partial messages on many streams that fill the connection window
    (aioquic's sender serves its streams in turn). So the oldest message in progress (its
    size announced by its prefix, at most the maximum message size) is promoted: its
    stream's window grows to its size plus `FRAMING_SLACK`, the connection's window by as
    much, and what the other streams hold beyond the connection window does not count
    against it. Other streams keep their window until their message's turn. Credit is granted
    by `credit_limit`, which never leaves a peer blocked while the reader waits for the rest
    of a message: the promoted message always completes, then the next one is promoted.
    Memory bound: a connection holds at most its window plus one maximum message + 5 +
    `FRAMING_SLACK`, except while other streams hold partial messages beyond the window: then
    what their windows allow (a stream window per open stream) plus that maximum message.
    """

    def __init__(
        self,
        quic: QuicConnection,
        stream_window: int = DEFAULT_STREAM_WINDOW,
        connection_window: int = DEFAULT_CONNECTION_WINDOW,
    ) -> None:
        self.quic = quic
        self.stream_window = stream_window
        self.connection_window = connection_window
        self._unconsumed: defaultdict[int, int] = defaultdict(int)
        self._total_unconsumed = 0
        self._stopped: set[int] = set()
        # stream -> its message's size + FRAMING_SLACK, oldest first; the first is promoted
        self._in_progress: dict[int, int] = {}
        self._promoted: int | None = None
        original_stream_limits = quic._write_stream_limits
        unconsumed = self._unconsumed
        stopped = self._stopped
        in_progress = self._in_progress
        half_window = stream_window // 2

        # Called for every stream in every packet aioquic builds: kept lean.
        def write_stream_limits(
            conn: QuicConnection, builder: QuicPacketBuilder, space: object, stream: QuicStream
        ) -> None:
            stream_id = stream.stream_id
            if stream_id is None or stream_id & 2:
                original_stream_limits(builder, space, stream)  # type: ignore[arg-type]
                return
            local = stream.max_stream_data_local
            if not local or stream_id in stopped:
                return
            need = in_progress.get(stream_id, 0)
            held = unconsumed.get(stream_id, 0)
            window = need if need > stream_window and stream_id == self._promoted else stream_window
            stream.max_stream_data_local = local = credit_limit(
                local, stream.receiver.highest_offset, held, window, half_window, held <= need
            )
            if stream.max_stream_data_local_sent != local:
                self._send_stream_credit(builder, stream)

        def write_connection_limits(
            conn: QuicConnection, builder: QuicPacketBuilder, space: object
        ) -> None:
            self._write_connection_credit(builder)

        quic._write_stream_limits = types.MethodType(write_stream_limits, quic)  # type: ignore[method-assign]
        quic._write_connection_limits = types.MethodType(write_connection_limits, quic)  # type: ignore[method-assign]

    def received(self, stream_id: int, size: int) -> None:
        """The stream now holds `size` more payload bytes nobody has consumed yet."""
        self._unconsumed[stream_id] += size
        self._total_unconsumed += size

    def consumed(self, stream_id: int, size: int) -> None:
        """The application took `size` bytes out of the stream: the peer may send more."""
        size = min(size, self._unconsumed.get(stream_id, 0))
        self._unconsumed[stream_id] -= size
        self._total_unconsumed -= size

    def message_in_progress(self, stream_id: int, size: int) -> None:
        """The stream is receiving a message of `size` bytes on the wire (0: none)."""
        if size:
            self._in_progress[stream_id] = size + FRAMING_SLACK
        else:
            self._in_progress.pop(stream_id, None)
        self._promote()

    def stop(self, stream_id: int) -> None:
        """Nobody reads this stream any more: no more credit for it, what it holds is freed."""
        if len(self._stopped) >= _PRUNE_STOPPED:
            self._stopped.intersection_update(self.quic._streams)  # those aioquic still has
        self._stopped.add(stream_id)
        self._in_progress.pop(stream_id, None)
        self._promote()
        self._total_unconsumed -= self._unconsumed.pop(stream_id, 0)

    def forget(self, stream_id: int) -> None:
        """The call is over; whatever it left unread no longer holds credit back (a stopped
        stream stays stopped while aioquic keeps it)."""
        self._in_progress.pop(stream_id, None)
        self._promote()
        self._total_unconsumed -= self._unconsumed.pop(stream_id, 0)

    def _promote(self) -> None:
        self._promoted = next(iter(self._in_progress), None)

    @property
    def unconsumed(self) -> int:
        return self._total_unconsumed

    def _send_stream_credit(self, builder: QuicPacketBuilder, stream: QuicStream) -> None:
        buf = builder.start_frame(
            QuicFrameType.MAX_STREAM_DATA,
            capacity=MAX_STREAM_DATA_FRAME_CAPACITY,
            handler=self.quic._on_max_stream_data_delivery,
            handler_args=(stream,),
        )
        buf.push_uint_var(stream.stream_id or 0)
        buf.push_uint_var(stream.max_stream_data_local)
        stream.max_stream_data_local_sent = stream.max_stream_data_local

    def _write_connection_credit(self, builder: QuicPacketBuilder) -> None:
        quic = self.quic
        max_data = quic._local_max_data
        window = self.connection_window
        held = self._total_unconsumed
        if self._promoted is not None:
            window += self._in_progress[self._promoted]
            held = min(held, self.connection_window + self._unconsumed.get(self._promoted, 0))
        max_data.value = credit_limit(
            max_data.value,
            max_data.used,
            held,
            window,
            self.connection_window // 2,
            True,  # whatever the streams hold, the peer is never kept from what it may send
        )
        for limit in (max_data, quic._local_max_streams_bidi, quic._local_max_streams_uni):
            if limit is not max_data and limit.sent - limit.used >= limit.value - limit.sent:
                continue  # batch MAX_STREAMS as aioquic does
            if limit.value != limit.sent:
                buf = builder.start_frame(
                    limit.frame_type,
                    capacity=CONNECTION_LIMIT_FRAME_CAPACITY,
                    handler=quic._on_connection_limit_delivery,
                    handler_args=(limit,),
                )
                buf.push_uint_var(limit.value)
                limit.sent = limit.value


def send_buffered(quic: QuicConnection, stream_id: int) -> int:
    """Bytes written to a stream and not yet acknowledged by the peer."""
    stream = quic._streams.get(stream_id)
    return 0 if stream is None else len(stream.sender._buffer)


def ack_with_next_packet(quic: QuicConnection, now: float) -> None:
    """Let a pending ACK ride in the next packet. aioquic holds an ACK back until its delay
    (1 ms) expired even when it sends stream data before then, and then sends it in a packet
    of its own: a client that sends its next call right after an answer sent an ACK-only
    packet after each, one more packet for the server to receive per call."""
    space = quic._spaces.get(tls.Epoch.ONE_RTT)
    if space is not None and space.ack_at is not None and space.ack_at > now:
        space.ack_at = now


# How long an ACK may wait for data to ride with, below the max_ack_delay aioquic announces
# (25 ms), so the peer's loss detection already allows for it.
ACK_DELAY_S = 0.01


def delay_acks(quic: QuicConnection) -> None:
    """Hold ACKs back up to `ACK_DELAY_S` instead of aioquic's 1 ms. A unary call's answer
    takes a few milliseconds: with 1 ms the request's ACK left alone first (a timer, a
    transmit, one more datagram for each end to handle per call); now it rides with the
    answer. `receive_datagram` keeps bulk transfers acknowledged at once."""
    quic._ack_delay = ACK_DELAY_S


def receive_datagram(quic: QuicConnection, data: bytes, addr: NetworkAddress, now: float) -> None:
    """aioquic's receive, acknowledging at once an ack-eliciting packet that arrives while an
    ACK is already held back: every second one, as RFC 9000 section 13.2.2 advises, so a
    sender of many packets is never kept waiting by `delay_acks`.

    aioquic sets `ack_at` only when an ack-eliciting packet arrives and none is set: clearing
    it for the receive tells whether this datagram held one (ACK-only packets and the
    handshake's Initial and Handshake packets, in other spaces, do not count)."""
    space = quic._spaces.get(tls.Epoch.ONE_RTT)
    held = None if space is None else space.ack_at
    if space is not None:
        space.ack_at = None
    quic.receive_datagram(data, addr, now=now)
    if space is not None and held is not None:
        space.ack_at = held if space.ack_at is None else now


# Connection IDs each end holds for the other: RFC 9000's minimum. aioquic issues 7 spare IDs
# per connection (a NEW_CONNECTION_ID frame, 24 random bytes and a routing entry each) to
# peers that allow 8 as it does itself; a gRPC client rarely migrates, and a retired ID is
# replaced.
ACTIVE_CONNECTION_IDS = 2


def limit_connection_ids(quic: QuicConnection) -> None:
    """Ask the peer for `ACTIVE_CONNECTION_IDS` connection IDs and issue it no more than that
    (aioquic has no setting for either)."""
    quic._local_active_connection_id_limit = ACTIVE_CONNECTION_IDS
    replenish = quic._replenish_connection_ids

    def replenish_up_to_limit() -> None:
        quic._remote_active_connection_id_limit = min(
            quic._remote_active_connection_id_limit, ACTIVE_CONNECTION_IDS
        )
        replenish()

    quic._replenish_connection_ids = replenish_up_to_limit  # type: ignore[method-assign]


def set_max_concurrent_streams(quic: QuicConnection, limit: int) -> None:
    """aioquic hard-codes 128; must be called before the transport parameters are sent."""
    quic._local_max_streams_bidi.value = limit
    quic._local_max_streams_bidi.sent = limit


def configure_tls(quic: QuicConnection, configure: Callable[[tls.Context], None]) -> None:
    """Run `configure` on a server connection's TLS context as soon as it exists: aioquic
    creates it when the first packet arrives and offers no setting for what is done here."""
    initialize = quic._initialize

    def initialize_and_configure(peer_cid: bytes) -> None:
        initialize(peer_cid)
        configure(quic.tls)

    quic._initialize = initialize_and_configure  # type: ignore[method-assign]


def refuse_early_data(quic: QuicConnection) -> None:
    """Issue tickets that do not allow early data (resumption stays)."""

    def without_early_data(context: tls.Context) -> None:
        context._max_early_data = None

    configure_tls(quic, without_early_data)


CertificateCheck = Callable[[x509.Certificate | None, list[x509.Certificate]], None]

# A private-use TLS extension type (RFC 8446 section 4.2: 65280-65535). In the server's own copy
# of a session ticket, one entry per certificate of the chain the client authenticated with, leaf
# first. A server never sends its copy's extensions; aioquic reads ticket extensions on clients
# only (the transport parameters for 0-RTT).
CLIENT_CERTIFICATE_EXTENSION = 0xFF5C


def request_client_certificate(context: tls.Context, check: CertificateCheck) -> None:
    """Ask the client for a certificate and hand what it sends (leaf or None, then the chain)
    to `check`, which raises a `tls.Alert` to refuse it. aioquic asks only behind a private
    flag, and on a server it checks the client's handshake signature (proof it holds the key)
    but never the chain: `verify_mode`/`cafile` do nothing there.

    A resumed handshake (session ticket, 0-RTT) sends no CertificateRequest, as TLS 1.3 wants,
    but behind that flag aioquic 1.7.2 still waits for a Certificate and aborts at the
    client's Finished (unexpected_message, QUIC error 0x10a). So here the server's tickets
    carry the chain the client authenticated with; a resumption passes it to `check` again (a
    ticket whose chain no longer passes is refused: full handshake, certificate asked anew),
    restores it as the peer certificate before any early data is read, and expects Finished
    next. Only the client holding the ticket's resumption secret can complete a resumption
    (the PSK binder), so a ticket authenticates the client it was issued to and no other."""
    context._request_client_certificate = True
    handle_certificate = context._server_handle_certificate
    handle_hello = context._server_handle_hello
    fetch = context.get_session_ticket_cb
    issue = context.new_session_ticket_cb
    resumed: list[x509.Certificate] = []

    def handle_and_check(input_buf: Buffer) -> None:
        handle_certificate(input_buf)
        check(context._peer_certificate, context._peer_certificate_chain)

    def fetch_and_check(label: bytes) -> tls.SessionTicket | None:
        assert fetch is not None
        ticket = fetch(label)
        if ticket is None:
            return None
        chain = [
            x509.load_der_x509_certificate(data)
            for kind, data in ticket.other_extensions
            if kind == CLIENT_CERTIFICATE_EXTENSION
        ]
        try:
            check(chain[0] if chain else None, chain[1:])
        except tls.Alert:
            return None
        resumed[:] = chain
        return ticket

    def handle_hello_and_resume(
        input_buf: Buffer, initial_buf: Buffer, handshake_buf: Buffer
    ) -> None:
        handle_hello(input_buf, initial_buf, handshake_buf)
        if context._session_resumed and context.state == tls.State.SERVER_EXPECT_CERTIFICATE:
            if resumed:
                context._peer_certificate, context._peer_certificate_chain = (
                    resumed[0],
                    resumed[1:],
                )
            context._server_expect_finished()

    def issue_with_certificate(ticket: tls.SessionTicket) -> None:
        assert issue is not None
        leaf = context._peer_certificate
        if leaf is not None:
            ticket.other_extensions = [
                *ticket.other_extensions,
                *(
                    (CLIENT_CERTIFICATE_EXTENSION, certificate.public_bytes(Encoding.DER))
                    for certificate in (leaf, *context._peer_certificate_chain)
                ),
            ]
        issue(ticket)

    context._server_handle_certificate = handle_and_check  # type: ignore[method-assign]
    context._server_handle_hello = handle_hello_and_resume  # type: ignore[method-assign]
    if fetch is not None:
        context.get_session_ticket_cb = fetch_and_check
    if issue is not None:
        context.new_session_ticket_cb = issue_with_certificate


def peer_certificate(quic: QuicConnection) -> x509.Certificate | None:
    """A server connection's client certificate: verified in its handshake, or restored from
    its session ticket when it resumed (`request_client_certificate`)."""
    return quic.tls._peer_certificate


def resend_early_data_after_retry(quic: QuicConnection) -> None:
    """A client's 0-RTT data must be sent again after a Retry (the server dropped it with
    the Initial it answered with Retry). aioquic starts new packet spaces on Retry and drops
    the old ones' packets without reporting them lost, so their stream data was never sent
    again and the calls hung. Here they are reported lost: their data goes out again, as
    0-RTT with the new Initial."""
    receive_retry = quic._receive_retry_packet

    def receive_retry_packet(header: Any, packet_without_tag: bytes, now: float) -> None:
        retries = quic._retry_count
        old_space = quic._spaces.get(tls.Epoch.ONE_RTT)
        receive_retry(header, packet_without_tag, now)
        if quic._retry_count != retries and old_space is not None and old_space.sent_packets:
            quic._loss._on_packets_lost(
                congestion_event=False,
                now=now,
                packets=list(old_space.sent_packets.values()),
                space=old_space,
            )

    quic._receive_retry_packet = receive_retry_packet  # type: ignore[method-assign]


def peer_address(quic: QuicConnection) -> NetworkAddress | None:
    """The address the connection's packets come from, once one arrived."""
    paths = quic._network_paths
    return paths[0].addr if paths else None


class FieldSectionTooLarge(Exception):
    """A header block (its encoded frame or its decoded fields) exceeds the limit."""

    def __init__(self, stream_id: int, size: int) -> None:
        super().__init__(f"header block of {size} bytes on stream {stream_id}")
        self.stream_id = stream_id
        self.size = size


class StaticTableEncoder:
    """pylsqpack's QPACK encoder kept to the static table, whatever the peer's SETTINGS allow.

    With a dynamic table, every header block that uses it makes the peer's decoder send a
    Section Acknowledgment on its decoder stream, which goes out in a packet of its own: for
    a unary call, one more packet each way (and the receive, ACK and transmit work for it).
    gRPC header blocks are small and the message dominates the bytes, so dropping the
    dynamic table costs a few bytes per call and saves those packets."""

    def __init__(self) -> None:
        self._encoder = pylsqpack.Encoder()

    def apply_settings(self, max_table_capacity: int, blocked_streams: int) -> bytes:
        return self._encoder.apply_settings(max_table_capacity=0, blocked_streams=0)

    def encode(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes]:
        return self._encoder.encode(stream_id, headers)

    def feed_decoder(self, data: bytes) -> None:
        self._encoder.feed_decoder(data)


class GrpcH3Connection(H3Connection):
    """H3Connection that sends and reports GOAWAY, advertises and enforces a maximum header
    block size, and reports the bytes it buffers in partial frames.

    aioquic 1.7.2 skips a received GOAWAY's payload without a word (its control stream parser
    only hands SETTINGS and MAX_PUSH_ID to `_handle_control_frame`), so the peer's control
    stream is read a second time here, for GOAWAY frames only.

    aioquic buffers a HEADERS frame whole, whatever size its header announces, and neither
    advertises nor checks SETTINGS_MAX_FIELD_SECTION_SIZE. Here a request stream whose
    HEADERS frame announces more than `max_field_section` bytes, or whose decoded fields
    exceed it, is refused as soon as that is known: `on_too_large(stream_id, size)`; the
    stream's later data is dropped unparsed. The encoded size bounds the decoded size from
    below (every field costs at least 32), so the early check refuses nothing legitimate.
    """

    def __init__(
        self,
        quic: QuicConnection,
        *,
        max_field_section: int,
        on_goaway: Callable[[int], None],
        on_too_large: Callable[[int, int], None],
        on_buffered: Callable[[int, int], None],
    ) -> None:
        self._max_field_section = max_field_section
        super().__init__(quic)  # sends our SETTINGS: QPACK without a dynamic table
        self._max_table_capacity = self._blocked_streams = 0
        self._decoder = pylsqpack.Decoder(0, 0)  # nothing was decoded yet
        self._encoder = StaticTableEncoder()  # type: ignore[assignment]  # the same methods
        self._on_goaway = on_goaway
        self._on_too_large = on_too_large
        self._on_buffered = on_buffered
        self._peer_control = GoawayReader()
        self._dropped: set[int] = set()

    def send_goaway(self, stream_id: int) -> None:
        assert self._local_control_stream_id is not None
        self._quic.send_stream_data(
            self._local_control_stream_id,
            encode_frame(FrameType.GOAWAY, encode_uint_var(stream_id)),
        )

    @property
    def peer_max_field_section(self) -> int | None:
        """The peer's SETTINGS_MAX_FIELD_SECTION_SIZE, once its SETTINGS arrived."""
        settings = self.received_settings
        return None if settings is None else settings.get(Setting.MAX_FIELD_SECTION_SIZE)

    def handle_event(self, event: events.QuicEvent) -> list[H3Event]:
        if (
            isinstance(event, events.StreamDataReceived | events.StreamReset)
            and event.stream_id in self._dropped
        ):
            if isinstance(event, events.StreamReset) or event.end_stream:
                self._dropped.discard(event.stream_id)  # nothing more can arrive on it
                self._stream.pop(event.stream_id, None)
            return []
        try:
            h3_events = super().handle_event(event)
        except FieldSectionTooLarge as exc:
            self._drop(exc.stream_id)
            self._on_too_large(exc.stream_id, exc.size)
            return []
        # aioquic learns which stream is the peer's control stream from its first bytes,
        # which it has just parsed: every byte of that stream passes here after it did.
        if (
            isinstance(event, events.StreamDataReceived)
            and event.stream_id == self._peer_control_stream_id
            and not self._is_done
        ):
            for stream_id in self._peer_control.feed(event.data):
                self._on_goaway(stream_id)
        return h3_events

    def _get_local_settings(self) -> dict[int, int]:
        settings = super()._get_local_settings()
        settings[Setting.MAX_FIELD_SECTION_SIZE] = self._max_field_section
        settings[Setting.QPACK_MAX_TABLE_CAPACITY] = 0
        settings[Setting.QPACK_BLOCKED_STREAMS] = 0
        return settings

    def _receive_request_or_push_data(
        self, stream: Any, data: bytes, stream_ended: bool
    ) -> list[H3Event]:
        h3_events = super()._receive_request_or_push_data(stream, data, stream_ended)
        if stream.frame_type == FrameType.HEADERS and stream.frame_size is not None:
            self._check(stream.stream_id, stream.frame_size)  # announced, not yet buffered
        self._on_buffered(stream.stream_id, len(stream.buffer))
        return h3_events

    def _handle_request_or_push_frame(
        self, frame_type: int, frame_data: bytes | None, stream: Any, stream_ended: bool
    ) -> list[H3Event]:
        if frame_type == FrameType.HEADERS and frame_data is not None:
            self._check(stream.stream_id, len(frame_data))
        h3_events = super()._handle_request_or_push_frame(
            frame_type, frame_data, stream, stream_ended
        )
        for h3_event in h3_events:
            if isinstance(h3_event, HeadersReceived):
                self._check(stream.stream_id, field_section_size(h3_event.headers))
        return h3_events

    def _check(self, stream_id: int, size: int) -> None:
        if size > self._max_field_section:
            raise FieldSectionTooLarge(stream_id, size)

    def _drop(self, stream_id: int) -> None:
        """Forget aioquic's state of a refused stream and ignore what else arrives on it."""
        self._dropped.add(stream_id)
        self._stream.pop(stream_id, None)
        self._on_buffered(stream_id, 0)


class Admission(Enum):
    ACCEPT = "accept"
    RETRY = "retry"  # answer with a Retry packet: the client must prove its address
    REFUSE = "refuse"  # close at once with CONNECTION_REFUSED, keeping no state


class AdmittingQuicServer(QuicServer):
    """aioquic's QuicServer, asking `admit(address, has_token)` before it creates state for a
    new connection. aioquic's Retry is all or nothing (`retry=True`); here it is built with a
    token handler and the handler is set aside for the Initials that `admit` lets through
    without Retry. Tokens that arrive are always validated."""

    def __init__(
        self,
        *,
        admit: Callable[[NetworkAddress, bool], Admission],
        sock: socket.socket | None = None,
        steer: Callable[[bytes, NetworkAddress], bool] | None = None,
        **kwargs: Any,
    ):
        """`sock`: the endpoint's socket, from `transport.h3.udp.bind`, read in bursts.
        `steer(datagram, address)`: True when it took a short-header datagram away (one for a
        connection another process owns, transport/h3/datagram_routing.py)."""
        super().__init__(retry=True, **kwargs)
        self._admit = admit
        self._sock = sock
        self._steer = steer

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        self._receive(cast(bytes, data), addr)
        if self._sock is not None:
            for more, more_addr in udp.queued(self._sock, udp.MAX_BURST - 1):
                self._receive(more, more_addr)

    def receive_forwarded(self, data: bytes, addr: NetworkAddress) -> None:
        """A datagram another process received for a connection of this one."""
        super().datagram_received(data, addr)

    def _receive(self, data: bytes, addr: NetworkAddress) -> None:
        if self._steer is not None and self._steer(data, addr):
            return
        if len(data) < SMALLEST_MAX_DATAGRAM_SIZE or not data[0] & 0x80:
            super().datagram_received(data, addr)  # not a long-header Initial: most traffic
            return
        try:
            header = pull_quic_header(
                Buffer(data=data), host_cid_length=self._configuration.connection_id_length
            )
        except ValueError:
            return
        if (
            header.packet_type != QuicPacketType.INITIAL
            or header.destination_cid in self._protocols
            or header.version not in self._configuration.supported_versions
        ):
            super().datagram_received(data, addr)
            return
        admission = self._admit(addr, bool(header.token))
        if admission is Admission.REFUSE:
            assert self._transport is not None and header.version is not None
            self._transport.sendto(
                encode_refusal(header.version, header.destination_cid, header.source_cid), addr
            )
        elif admission is Admission.RETRY or header.token:
            super().datagram_received(data, addr)
        else:
            with self._without_retry():
                super().datagram_received(data, addr)

    @contextlib.contextmanager
    def _without_retry(self) -> Iterator[None]:
        retry = self._retry
        self._retry = None  # type: ignore[assignment]  # aioquic's own "no Retry" value
        try:
            yield
        finally:
            self._retry = retry

    @property
    def port(self) -> int:
        assert self._transport is not None
        return int(self._transport.get_extra_info("sockname")[1])


class _TaggingOs(types.ModuleType):
    """The `os` aioquic's connection module sees: `urandom(length)` for connection IDs of
    `length` bytes starts with `tag`; everything else is the real `os`."""

    def __init__(self, tag: int, length: int) -> None:
        super().__init__("os")
        self._tag = bytes((tag,))
        self._length = length

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def urandom(self, size: int) -> bytes:
        if size == self._length:
            return self._tag + os.urandom(size - 1)
        return os.urandom(size)


def tag_connection_ids(tag: int, length: int) -> None:
    """Every connection ID of `length` bytes this process's QUIC connections issue starts with
    the byte `tag` (aioquic draws them with `os.urandom(configuration.connection_id_length)`
    in `aioquic.quic.connection`, for the first ID and for NEW_CONNECTION_ID frames). Use a
    length no other random value of that module has (aioquic draws 8 and 16 bytes)."""
    connection_module.os = _TaggingOs(tag, length)  # type: ignore[attr-defined]


def encode_refusal(version: int, source_cid: bytes, destination_cid: bytes) -> bytes:
    """A server Initial packet closing the connection with CONNECTION_REFUSED, as aioquic's
    private `_encode_invalid_token_close` does for INVALID_TOKEN. It is smaller than the
    client's Initial (at least 1200 bytes), so it cannot amplify a spoofed address."""
    crypto = CryptoPair()
    crypto.setup_initial(cid=source_cid, is_client=False, version=version)
    builder = QuicPacketBuilder(
        host_cid=source_cid,
        is_client=False,
        max_datagram_size=SMALLEST_MAX_DATAGRAM_SIZE,
        peer_cid=destination_cid,
        version=version,
    )
    builder.start_packet(QuicPacketType.INITIAL, crypto)
    buf = builder.start_frame(
        QuicFrameType.TRANSPORT_CLOSE, capacity=TRANSPORT_CLOSE_FRAME_CAPACITY
    )
    buf.push_uint_var(QuicErrorCode.CONNECTION_REFUSED)
    buf.push_uint_var(QuicFrameType.PADDING)
    reason = b"too many connections"
    buf.push_uint_var(len(reason))
    buf.push_bytes(reason)
    datagrams, _ = builder.flush()
    return datagrams[0]
