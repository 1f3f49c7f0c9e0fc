"""aioquic's H3Connection with GOAWAY, bounded header blocks, QPACK without a dynamic table, and
the bytes it buffers in partial frames reported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pylsqpack
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import (
    FrameType,
    H3Connection,
    QpackDecompressionFailed,
    Setting,
    encode_frame,
)
from aioquic.h3.events import H3Event, Headers, HeadersReceived
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from transport.grpc.headers import field_section_size
from transport.h3.aioquic.goaway import GoawayReader


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

    # Without a dynamic table neither QPACK end ever has instructions for its stream, but
    # aioquic writes them for every header block, empty: a stream lookup and a send each, a
    # tenth of what sending a block costs. These write only what there is.

    def _encode_headers(self, stream_id: int, headers: Headers) -> bytes:
        encoder, frame_data = self._encoder.encode(stream_id, headers)
        if encoder:
            assert self._local_encoder_stream_id is not None
            self._encoder_bytes_sent += len(encoder)
            self._quic.send_stream_data(self._local_encoder_stream_id, encoder)
        return frame_data

    def _decode_headers(self, stream_id: int, frame_data: bytes | None) -> Headers:
        try:
            if frame_data is None:
                decoder, headers = self._decoder.resume_header(stream_id)
            else:
                decoder, headers = self._decoder.feed_header(stream_id, frame_data)
        except pylsqpack.DecompressionFailed as exc:
            raise QpackDecompressionFailed() from exc
        if decoder:
            assert self._local_decoder_stream_id is not None
            self._decoder_bytes_sent += len(decoder)
            self._quic.send_stream_data(self._local_decoder_stream_id, decoder)
        return headers

    def _check(self, stream_id: int, size: int) -> None:
        if size > self._max_field_section:
            raise FieldSectionTooLarge(stream_id, size)

    def _drop(self, stream_id: int) -> None:
        """Forget aioquic's state of a refused stream and ignore what else arrives on it."""
        self._dropped.add(stream_id)
        self._stream.pop(stream_id, None)
        self._on_buffered(stream_id, 0)
