"""What gRPC over HTTP/3 needs on both ends of a QUIC connection, and aioquic lacks: GOAWAY,
stream resets as events, application-driven flow control with send backpressure, bounded
header blocks, failing every stream when the connection dies, and keepalive pings.

What a stream received is kept in a `StreamState` (no I/O); `H3Stream` adds its waiters, and
the asyncio protocol only moves events to streams and wakes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from transport.grpc.framing import DEFAULT_MAX_MESSAGE
from transport.grpc.status import (
    H3_NO_ERROR,
    H3_REQUEST_CANCELLED,
    H3_REQUEST_REJECTED,
    status_from_h3_error,
)
from transport.h3.aioquic.internals import (
    GrpcH3Connection,
    ReceiveCredit,
    ack_with_next_packet,
    delay_acks,
    limit_connection_ids,
    receive_datagram,
    send_buffered,
    set_max_concurrent_streams,
)
from transport.h3.stream_state import Headers, StreamState
from transport.h3.stream_state import StreamClosed as StreamClosed

log = logging.getLogger("paddlequic.h3")

SEND_HIGH_WATER = 1 << 20  # a writer waits while this much is unacknowledged on its stream
DEFAULT_MAX_METADATA = 16 << 10
# UDP payload of the datagrams sent: QUIC guarantees only 1200; 1350 is what Chromium's QUIC
# stack sends by default without path MTU discovery (with IPv6 and UDP headers it fits a tunnel
# MTU of 1400). A unary call with a 1 KiB tensor then fits one datagram instead of two: one
# datagram less to receive, decrypt and acknowledge per call.
DEFAULT_MAX_DATAGRAM = 1350


@dataclass(frozen=True)
class H3Settings:
    max_message: int = DEFAULT_MAX_MESSAGE
    max_metadata: int = DEFAULT_MAX_METADATA  # largest header block, as SETTINGS announce it
    max_concurrent_streams: int = 256
    stream_window: int = 1 << 20
    connection_window: int = 16 << 20
    keepalive_s: float | None = None  # PING this often while the connection is open
    max_datagram_size: int = DEFAULT_MAX_DATAGRAM


class H3Stream:
    """One request stream: its `StreamState`, waiters, outgoing data with backpressure."""

    def __init__(self, protocol: GrpcH3Protocol, stream_id: int) -> None:
        self.protocol = protocol
        self.stream_id = stream_id
        self.state = StreamState(protocol.settings.max_message)
        self.sent_end = False
        self.send_error: StreamClosed | None = None  # the peer stopped reading (STOP_SENDING)
        self._changed = asyncio.Event()
        self._credited = 0  # state.held as last reported to the connection's credit
        self._in_progress = 0  # state.in_progress as last reported
        self.early = False  # opened before the handshake completed: arrived as 0-RTT data
        self.on_headers: Callable[[], None] | None = None
        self.on_reset: Callable[[StreamClosed], None] | None = None

    @property
    def headers(self) -> Headers | None:
        return self.state.headers

    @property
    def trailers(self) -> Headers | None:
        return self.state.trailers

    @property
    def ended(self) -> bool:
        return self.state.ended

    @property
    def error(self) -> StreamClosed | None:
        return self.state.error

    # events from the connection

    def headers_received(self, headers: Headers, ended: bool) -> None:
        self.state.headers_received(headers, ended)
        if self.state.error is not None:
            self._failed()
        if self.on_headers is not None:
            self.on_headers()
        self._changed.set()

    def data_received(self, data: bytes, ended: bool) -> None:
        if self.state.data_received(data, ended):
            self._sync_credit()
        elif self.state.error is not None:
            self._failed()
        self._changed.set()

    def fail(self, error: StreamClosed) -> None:
        if self.state.fail(error):
            self._failed()
        self._changed.set()

    def stop_sending(self, error: StreamClosed) -> None:
        """The peer reads no more (it may still answer, e.g. with an error status)."""
        if self.send_error is None:
            self.send_error = error
        self.protocol.wake_senders()

    def _failed(self) -> None:
        """Nobody will read this stream: stop the peer's sending (our side stays open to answer
        with the status) and release the credit it held. A server answers a request failed on
        malformed input completely, so its stop says H3_NO_ERROR (RFC 9114 4.1.2):
        H3_REQUEST_CANCELLED would make clients such as libcurl discard that answer."""
        assert self.state.error is not None
        answered = self.state.malformed and self.protocol.answers_malformed
        self.protocol.stop_receiving(
            self.stream_id, H3_NO_ERROR if answered else H3_REQUEST_CANCELLED
        )
        self._credited = 0
        if self.on_reset is not None:
            self.on_reset(self.state.error)
        self.protocol.wake_senders()

    def _sync_credit(self) -> None:
        if self.state.in_progress != self._in_progress:
            self._in_progress = self.state.in_progress
            self.protocol.credit.message_in_progress(self.stream_id, self._in_progress)
        held = self.state.held
        if held > self._credited:
            self.protocol.credit.received(self.stream_id, held - self._credited)
        elif held < self._credited:
            self.protocol.credit.consumed(self.stream_id, self._credited - held)
            self.protocol.transmit_soon()
        self._credited = held

    # what a call uses

    async def read_message(self) -> bytes | None:
        """The next message; None when the peer finished sending."""
        while True:
            message = self.state.take_message()
            if message is not None:
                self._sync_credit()
                return message
            if self.state.error is not None:
                raise self.state.error
            if self.state.ended:
                return None
            self._changed.clear()
            await self._changed.wait()

    async def wait_headers(self) -> Headers:
        while self.headers is None:
            if self.error is not None:
                raise self.error
            self._changed.clear()
            await self._changed.wait()
        return self.headers

    async def wait_closed(self) -> None:
        """Until the peer finished sending (or the stream failed)."""
        while not self.ended and self.error is None:
            self._changed.clear()
            await self._changed.wait()

    async def send_data(self, data: bytes, end: bool = False) -> None:
        await self.protocol.wait_send_window(self)
        self._check_sendable()
        self.protocol.h3_send_data(self.stream_id, data, end)
        self.sent_end = end

    def send_headers(self, headers: Headers, end: bool = False) -> None:
        self._check_sendable()
        self.protocol.h3_send_headers(self.stream_id, headers, end)
        self.sent_end = end

    def _check_sendable(self) -> None:
        """A stream that failed on the peer's malformed input still sends its answer (the
        status says what was wrong); one reset, stopped or on a dead connection does not."""
        if self.error is not None and not self.state.malformed:
            raise self.error
        if self.send_error is not None:
            raise self.send_error

    def cancel(self, error_code: int = H3_REQUEST_CANCELLED) -> None:
        if self.error is None:
            self.fail(StreamClosed(grpc.StatusCode.CANCELLED, "Cancelled"))
        self.protocol.reset(self.stream_id, error_code)


class GrpcH3Protocol(QuicConnectionProtocol):
    """Base of the server and client protocols."""

    answers_malformed = False  # a stream failed on the peer's bad input still gets an answer

    def __init__(
        self, quic: QuicConnection, stream_handler: object = None, *, settings: H3Settings
    ) -> None:
        super().__init__(quic)
        self.settings = settings
        set_max_concurrent_streams(quic, self.settings.max_concurrent_streams)
        delay_acks(quic)
        limit_connection_ids(quic)
        self.credit = ReceiveCredit(
            quic, self.settings.stream_window, self.settings.connection_window
        )
        self.h3: GrpcH3Connection | None = None
        self.streams: dict[int, H3Stream] = {}
        self.goaway_stream_id: int | None = None
        self.terminated: StreamClosed | None = None
        self.peak_send_buffered = 0
        self._h3_held: dict[int, int] = {}
        self.blocked_writers = 0
        self._send_wakeup = asyncio.Event()
        self._keepalive: asyncio.Task[None] | None = None

    def ensure_h3(self) -> GrpcH3Connection:
        if self.h3 is None:
            self.h3 = GrpcH3Connection(
                self._quic,
                max_field_section=self.settings.max_metadata,
                on_goaway=self._goaway_received,
                on_too_large=self._header_block_too_large,
                on_buffered=self._h3_buffered,
            )
            if self.settings.keepalive_s:
                self._keepalive = asyncio.get_running_loop().create_task(self._keepalive_loop())
        return self.h3

    # aioquic callbacks

    def datagram_received(self, data: bytes | str, addr: object) -> None:
        """As aioquic's, but transmitting once per event-loop turn rather than once per
        datagram: under load many datagrams arrive together, and every transmit walks all
        streams."""
        receive_datagram(self._quic, cast(bytes, data), cast(Any, addr), self._loop.time())
        self._process_events()
        self._transmit_soon()
        self.wake_senders()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        h3 = (
            self.ensure_h3()
            if isinstance(event, events.ProtocolNegotiated | events.StreamDataReceived)
            else self.h3
        )
        if isinstance(event, events.StreamReset | events.StopSendingReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                error = StreamClosed(
                    status_from_h3_error(event.error_code),
                    f"stream {'reset' if isinstance(event, events.StreamReset) else 'stopped'} "
                    f"by peer (HTTP/3 error 0x{event.error_code:x})",
                    refused=event.error_code == H3_REQUEST_REJECTED,
                )
                if isinstance(event, events.StreamReset):
                    stream.fail(error)
                else:
                    self.stop_sending_received(stream, error)
        if h3 is not None:
            for h3_event in h3.handle_event(event):
                self._h3_event_received(h3_event)
        if isinstance(event, events.HandshakeCompleted):
            self.handshake_completed(event)
        elif isinstance(event, events.ConnectionTerminated):
            self._terminated(event)

    def _h3_event_received(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            stream = self.streams.get(event.stream_id) or self.stream_opened(event.stream_id)
            if stream is not None:
                stream.headers_received(event.headers, event.stream_ended)
        elif isinstance(event, DataReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.data_received(event.data, event.stream_ended)

    def _terminated(self, event: events.ConnectionTerminated) -> None:
        reason = event.reason_phrase or f"error 0x{event.error_code:x}"
        self.terminated = StreamClosed(grpc.StatusCode.UNAVAILABLE, f"connection closed: {reason}")
        for stream in list(self.streams.values()):
            stream.fail(self.terminated)
        if self._keepalive is not None:
            self._keepalive.cancel()
        self.connection_lost_hook()

    # hooks for subclasses

    def stop_sending_received(self, stream: H3Stream, error: StreamClosed) -> None:
        """The peer will not read what we send on `stream`. A server's answer is then of no
        use: the call ends (the client overrides this: a server may stop the upload and
        still answer)."""
        stream.fail(error)

    def peer_max_field_section(self) -> int | None:
        """The largest header block the peer accepts, once its SETTINGS arrived."""
        return None if self.h3 is None else self.h3.peer_max_field_section

    def header_block_refused(self, stream_id: int, message: str) -> None:
        """A stream's first header block was too large (server side: answer it)."""
        self.stop_receiving(stream_id)

    def stream_opened(self, stream_id: int) -> H3Stream | None:
        """The peer opened a stream (server side); None refuses it."""
        return None

    def handshake_completed(self, event: events.HandshakeCompleted) -> None:
        pass

    def connection_lost_hook(self) -> None:
        pass

    def _goaway_received(self, stream_id: int) -> None:
        self.goaway_stream_id = stream_id

    # sending

    def h3_send_headers(self, stream_id: int, headers: Headers, end: bool) -> None:
        self.ensure_h3().send_headers(stream_id, headers, end_stream=end)
        self._send_soon()

    def h3_send_data(self, stream_id: int, data: bytes, end: bool) -> None:
        self.ensure_h3().send_data(stream_id, data, end_stream=end)
        buffered = send_buffered(self._quic, stream_id)
        self.peak_send_buffered = max(self.peak_send_buffered, buffered)
        self._send_soon()

    def _send_soon(self) -> None:
        """Stream data goes out this turn: a pending ACK goes with it."""
        ack_with_next_packet(self._quic, self._loop.time())
        self.transmit_soon()

    async def wait_send_window(self, stream: H3Stream) -> None:
        if stream.error is not None or stream.send_error or not self._send_blocked(stream):
            return
        self.blocked_writers += 1
        try:
            while stream.error is None and not stream.send_error and self._send_blocked(stream):
                self._send_wakeup.clear()
                await self._send_wakeup.wait()
        finally:
            self.blocked_writers -= 1

    def _send_blocked(self, stream: H3Stream) -> bool:
        return send_buffered(self._quic, stream.stream_id) >= SEND_HIGH_WATER

    def wake_senders(self) -> None:
        self._send_wakeup.set()

    def reset(self, stream_id: int, error_code: int = H3_REQUEST_CANCELLED) -> None:
        with contextlib.suppress(Exception):
            self._quic.reset_stream(stream_id, error_code)
        with contextlib.suppress(Exception):
            self._quic.stop_stream(stream_id, error_code)
        self.transmit_soon()

    def stop_receiving(self, stream_id: int, error_code: int = H3_REQUEST_CANCELLED) -> None:
        """STOP_SENDING: nobody reads the stream any more, so it gets no more credit."""
        self.credit.stop(stream_id)
        self._h3_held.pop(stream_id, None)
        with contextlib.suppress(Exception):
            self._quic.stop_stream(stream_id, error_code)
        self.transmit_soon()

    def forget(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)
        self._h3_held.pop(stream_id, None)
        self.credit.forget(stream_id)

    def _h3_buffered(self, stream_id: int, size: int) -> None:
        """The H3 layer holds `size` bytes of a partial frame (a header block) of the stream:
        they hold credit back as unread messages do."""
        previous = self._h3_held.pop(stream_id, 0)
        if size:
            self._h3_held[stream_id] = size
        if size > previous:
            self.credit.received(stream_id, size - previous)
        elif size < previous:
            self.credit.consumed(stream_id, previous - size)

    def _header_block_too_large(self, stream_id: int, size: int) -> None:
        """The peer sent a header block over our SETTINGS_MAX_FIELD_SECTION_SIZE; aioquic
        dropped it, and the stream's later data. An open call fails with RESOURCE_EXHAUSTED;
        a request nobody saw yet is answered so without running (see the server)."""
        message = (
            f"header block of at least {size} bytes exceeds the limit of "
            f"{self.settings.max_metadata} bytes (SETTINGS_MAX_FIELD_SECTION_SIZE)"
        )
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.fail(StreamClosed(grpc.StatusCode.RESOURCE_EXHAUSTED, message))
        else:
            self.header_block_refused(stream_id, message)

    def transmit_soon(self) -> None:
        self._transmit_soon()

    async def _keepalive_loop(self) -> None:
        assert self.settings.keepalive_s
        while self.terminated is None:
            await asyncio.sleep(self.settings.keepalive_s)
            with contextlib.suppress(ConnectionError):
                await self.ping()
