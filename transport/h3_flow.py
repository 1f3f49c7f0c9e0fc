"""Application-driven QUIC flow control for aioquic.

aioquic grants the peer more credit as soon as data arrives, whether or not the application
read it, and buffers whatever is sent without limit (notes/aioquic.md). Here receive credit
follows what the application consumed, and senders can see how much they have buffered.

aioquic offers no hook for this, so `ReceiveCredit` replaces two private methods on one
`QuicConnection` instance. They were read from aioquic 1.7.2; the version is pinned.
"""

from __future__ import annotations

import types
from collections import defaultdict

from aioquic.quic.connection import (
    CONNECTION_LIMIT_FRAME_CAPACITY,
    MAX_STREAM_DATA_FRAME_CAPACITY,
    QuicConnection,
)
from aioquic.quic.packet import QuicFrameType
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.stream import QuicStream

DEFAULT_STREAM_WINDOW = 1 << 20
DEFAULT_CONNECTION_WINDOW = 16 << 20


class ReceiveCredit:
    """Credit = bytes the application consumed + window, per request stream and in total."""

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
        original_stream_limits = quic._write_stream_limits
        unconsumed = self._unconsumed
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
            if not local:
                return
            target = stream.receiver.highest_offset - unconsumed.get(stream_id, 0) + stream_window
            if target - local >= half_window:
                stream.max_stream_data_local = local = target
            if stream.max_stream_data_local_sent != local:
                self._send_stream_credit(builder, stream)

        def write_connection_limits(
            conn: QuicConnection, builder: QuicPacketBuilder, space: object
        ) -> None:
            self._write_connection_credit(builder)

        quic._write_stream_limits = types.MethodType(write_stream_limits, quic)  # type: ignore[method-assign]
        quic._write_connection_limits = types.MethodType(write_connection_limits, quic)  # type: ignore[method-assign]

    def received(self, stream_id: int, size: int) -> None:
        """The H3 layer handed `size` payload bytes to the application's buffer."""
        self._unconsumed[stream_id] += size
        self._total_unconsumed += size

    def consumed(self, stream_id: int, size: int) -> None:
        """The application took `size` bytes out of its buffer: the peer may send more."""
        size = min(size, self._unconsumed.get(stream_id, 0))
        self._unconsumed[stream_id] -= size
        self._total_unconsumed -= size

    def forget(self, stream_id: int) -> None:
        """The stream is over; whatever it left unread no longer holds credit back."""
        self._total_unconsumed -= self._unconsumed.pop(stream_id, 0)

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
        target = max_data.used - self._total_unconsumed + self.connection_window
        if target - max_data.value >= self.connection_window // 2:
            max_data.value = target
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


def set_max_concurrent_streams(quic: QuicConnection, limit: int) -> None:
    """aioquic hard-codes 128; must be called before the transport parameters are sent."""
    quic._local_max_streams_bidi.value = limit
    quic._local_max_streams_bidi.sent = limit
