"""What gRPC over HTTP/3 needs on both ends of a QUIC connection, and aioquic lacks: GOAWAY,
stream resets as events, application-driven flow control with send backpressure, failing
every stream when the connection dies, and keepalive pings.

Protocol state (which stream holds what) is kept in `H3Stream`; the asyncio protocol only moves
events to streams and wakes waiters.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import grpc
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.buffer import (  # type: ignore[attr-defined]
    Buffer,
    BufferReadError,
    encode_uint_var,
)
from aioquic.h3.connection import FrameType, H3Connection, encode_frame
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from transport.errors import ProtocolError
from transport.framing import DEFAULT_MAX_MESSAGE, MessageDecoder
from transport.h3_flow import ReceiveCredit, send_buffered, set_max_concurrent_streams
from transport.status import H3_REQUEST_CANCELLED, H3_REQUEST_REJECTED, status_from_h3_error

log = logging.getLogger("paddlequic.h3")

Headers = list[tuple[bytes, bytes]]

SEND_HIGH_WATER = 1 << 20  # a writer waits while this much is unacknowledged on its stream


@dataclass(frozen=True)
class H3Settings:
    max_message: int = DEFAULT_MAX_MESSAGE
    max_concurrent_streams: int = 256
    stream_window: int = 1 << 20
    connection_window: int = 16 << 20
    keepalive_s: float | None = None  # PING this often while the connection is open


class StreamClosed(Exception):
    """The stream ended abnormally; `status` is what the call should report."""

    def __init__(self, status: grpc.StatusCode, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.refused = refused  # the peer refused the stream unprocessed: safe to retry


class GrpcH3Connection(H3Connection):
    """H3Connection that sends and reports GOAWAY.

    aioquic 1.7.2 skips a received GOAWAY's payload without a word (its control stream parser
    only hands SETTINGS and MAX_PUSH_ID to `_handle_control_frame`), so the peer's control
    stream is read a second time here, for GOAWAY frames only.
    """

    def __init__(self, quic: QuicConnection, on_goaway: Callable[[int], None]) -> None:
        super().__init__(quic)
        self._on_goaway = on_goaway
        self._peer_control = _GoawayReader()

    def send_goaway(self, stream_id: int) -> None:
        assert self._local_control_stream_id is not None
        self._quic.send_stream_data(
            self._local_control_stream_id,
            encode_frame(FrameType.GOAWAY, encode_uint_var(stream_id)),
        )

    def handle_event(self, event: events.QuicEvent) -> list[H3Event]:
        h3_events = super().handle_event(event)
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


class _GoawayReader:
    """The GOAWAY frames of a control stream (stream type, then frames). Other frames'
    payloads are skipped as they arrive, never buffered."""

    _MAX_GOAWAY_PAYLOAD = 8  # one variable-length integer

    def __init__(self) -> None:
        self._buffer = b""
        self._typed = False  # the stream type was read
        self._skip = 0  # payload bytes of an uninteresting frame still to come

    def feed(self, data: bytes) -> list[int]:
        """The ids of the GOAWAY frames that `data` completes."""
        self._buffer += data
        found: list[int] = []
        while self._buffer:
            if self._skip:
                skipped = min(self._skip, len(self._buffer))
                self._buffer = self._buffer[skipped:]
                self._skip -= skipped
                continue
            buf = Buffer(data=self._buffer)
            try:
                if not self._typed:
                    buf.pull_uint_var()
                    self._typed = True
                    self._buffer = self._buffer[buf.tell() :]
                    continue
                frame_type = buf.pull_uint_var()
                size = buf.pull_uint_var()
            except BufferReadError:
                break  # a header split across packets: wait for the rest
            start = buf.tell()
            if frame_type != FrameType.GOAWAY or size > self._MAX_GOAWAY_PAYLOAD:
                self._buffer = self._buffer[start:]
                self._skip = size
                continue
            if len(self._buffer) < start + size:
                break
            payload = self._buffer[start : start + size]
            self._buffer = self._buffer[start + size :]
            with contextlib.suppress(BufferReadError):
                found.append(Buffer(data=payload).pull_uint_var())
        return found


class H3Stream:
    """One request stream: incoming headers and messages, outgoing data with backpressure."""

    def __init__(self, protocol: GrpcH3Protocol, stream_id: int) -> None:
        self.protocol = protocol
        self.stream_id = stream_id
        self.decoder = MessageDecoder(protocol.settings.max_message)
        self.headers: Headers | None = None
        self.trailers: Headers | None = None
        self.messages: collections.deque[bytes] = collections.deque()
        self.ended = False  # the peer finished sending
        self.error: StreamClosed | None = None
        self.sent_end = False
        self._changed = asyncio.Event()
        self.early = False  # opened before the handshake completed: arrived as 0-RTT data
        self.on_headers: Callable[[], None] | None = None
        self.on_reset: Callable[[StreamClosed], None] | None = None

    # events from the connection

    def headers_received(self, headers: Headers, ended: bool) -> None:
        if self.headers is None:
            self.headers = headers
        else:
            self.trailers = headers
        self._end(ended)
        if self.on_headers is not None:
            self.on_headers()
        self._changed.set()

    def data_received(self, data: bytes, ended: bool) -> None:
        try:
            for message in self.decoder.feed(data):
                self.messages.append(message)
                self.protocol.credit.received(self.stream_id, len(message) + 5)
        except ProtocolError as exc:
            # Stop the peer's sending; our side stays open to answer with this status.
            self.fail(StreamClosed(exc.status, exc.message))
            self.protocol.stop_receiving(self.stream_id)
            return
        self._end(ended)
        self._changed.set()

    def _end(self, ended: bool) -> None:
        if ended and not self.ended:
            self.ended = True
            try:
                self.decoder.finish()
            except ProtocolError as exc:
                self.fail(StreamClosed(exc.status, exc.message))

    def fail(self, error: StreamClosed) -> None:
        if self.error is None:
            self.error = error
            if self.on_reset is not None:
                self.on_reset(error)
        self._changed.set()
        self.protocol.wake_senders()

    # what a call uses

    async def read_message(self) -> bytes | None:
        """The next message; None when the peer finished sending."""
        while True:
            if self.messages:
                message = self.messages.popleft()
                self.protocol.credit.consumed(self.stream_id, len(message) + 5)
                self.protocol.transmit_soon()
                return message
            if self.error is not None:
                raise self.error
            if self.ended:
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
        if self.error is not None:
            raise self.error
        self.protocol.h3_send_data(self.stream_id, data, end)
        self.sent_end = end

    def send_headers(self, headers: Headers, end: bool = False) -> None:
        if self.error is not None:
            raise self.error
        self.protocol.h3_send_headers(self.stream_id, headers, end)
        self.sent_end = end

    def cancel(self, error_code: int = H3_REQUEST_CANCELLED) -> None:
        if self.error is None:
            self.fail(StreamClosed(grpc.StatusCode.CANCELLED, "Cancelled"))
        self.protocol.reset(self.stream_id, error_code)


class GrpcH3Protocol(QuicConnectionProtocol):
    """Base of the server and client protocols."""

    def __init__(
        self, quic: QuicConnection, stream_handler: object = None, *, settings: H3Settings
    ) -> None:
        super().__init__(quic)
        self.settings = settings
        set_max_concurrent_streams(quic, self.settings.max_concurrent_streams)
        self.credit = ReceiveCredit(
            quic, self.settings.stream_window, self.settings.connection_window
        )
        self.h3: GrpcH3Connection | None = None
        self.streams: dict[int, H3Stream] = {}
        self.goaway_stream_id: int | None = None
        self.terminated: StreamClosed | None = None
        self.peak_send_buffered = 0
        self.blocked_writers = 0
        self._send_wakeup = asyncio.Event()
        self._keepalive: asyncio.Task[None] | None = None

    def ensure_h3(self) -> GrpcH3Connection:
        if self.h3 is None:
            self.h3 = GrpcH3Connection(self._quic, self._goaway_received)
            if self.settings.keepalive_s:
                self._keepalive = asyncio.get_running_loop().create_task(self._keepalive_loop())
        return self.h3

    # aioquic callbacks

    def datagram_received(self, data: bytes | str, addr: object) -> None:
        """As aioquic's, but transmitting once per event-loop turn rather than once per
        datagram: under load many datagrams arrive together, and every transmit walks all
        streams."""
        self._quic.receive_datagram(cast(bytes, data), addr, now=self._loop.time())
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
                stream.fail(
                    StreamClosed(
                        status_from_h3_error(event.error_code),
                        f"stream reset by peer (HTTP/3 error 0x{event.error_code:x})",
                        refused=event.error_code == H3_REQUEST_REJECTED,
                    )
                )
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
        self.transmit_soon()

    def h3_send_data(self, stream_id: int, data: bytes, end: bool) -> None:
        self.ensure_h3().send_data(stream_id, data, end_stream=end)
        buffered = send_buffered(self._quic, stream_id)
        self.peak_send_buffered = max(self.peak_send_buffered, buffered)
        self.transmit_soon()

    async def wait_send_window(self, stream: H3Stream) -> None:
        if stream.error is not None or not self._send_blocked(stream):
            return
        self.blocked_writers += 1
        try:
            while stream.error is None and self._send_blocked(stream):
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
        with contextlib.suppress(Exception):
            self._quic.stop_stream(stream_id, error_code)
        self.transmit_soon()

    def forget(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)
        self.credit.forget(stream_id)

    def transmit_soon(self) -> None:
        self._transmit_soon()

    async def _keepalive_loop(self) -> None:
        assert self.settings.keepalive_s
        while self.terminated is None:
            await asyncio.sleep(self.settings.keepalive_s)
            with contextlib.suppress(ConnectionError):
                await self.ping()
