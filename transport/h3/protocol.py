"""What gRPC over HTTP/3 needs on both ends of a QUIC connection, and aioquic lacks: GOAWAY,
stream resets as events, application-driven flow control with send backpressure, bounded
header blocks, failing every stream when the connection dies, and keepalive pings.

What a stream received is kept in a `StreamState` (no I/O); `H3Stream` (stream.py) adds its
waiters, and the asyncio protocol only moves events to streams and wakes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, cast

import grpc
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from transport.grpc.status import (
    H3_REQUEST_CANCELLED,
    H3_REQUEST_REJECTED,
    status_from_h3_error,
)
from transport.h3.aioquic.acks import ack_with_next_packet, delay_acks, receive_datagram
from transport.h3.aioquic.connection import send_buffered, set_max_concurrent_streams
from transport.h3.aioquic.connection_ids import limit_connection_ids
from transport.h3.aioquic.credit import ReceiveCredit
from transport.h3.aioquic.h3_connection import GrpcH3Connection
from transport.h3.aioquic.lean_handshake import share_frame_epochs
from transport.h3.aioquic.quiet_receive import arm_timer, nothing_to_send
from transport.h3.settings import H3Settings
from transport.h3.stream import H3Stream
from transport.h3.stream_state import Headers, StreamClosed

log = logging.getLogger("paddlequic.h3")

SEND_HIGH_WATER = 1 << 20  # a writer waits while this much is unacknowledged on its stream

share_frame_epochs()  # before any QuicConnection of either end exists


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
        datagram (under load many datagrams arrive together, and every transmit walks all
        streams), and not at all when there is nothing to send yet (quiet_receive.py)."""
        now = self._loop.time()
        receive_datagram(self._quic, cast(bytes, data), cast(Any, addr), now)
        self._process_events()
        if self._transmit_task is None:
            if nothing_to_send(self._quic, self.credit, now):
                arm_timer(self)
            else:
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
        self.credit.close()
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
