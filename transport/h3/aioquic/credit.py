"""Receive credit that follows what the application consumed, not what arrived (aioquic's
stream and connection limit writers replaced)."""

from __future__ import annotations

import types
from collections import defaultdict
from collections.abc import Callable

from aioquic.quic.connection import (
    CONNECTION_LIMIT_FRAME_CAPACITY,
    MAX_STREAM_DATA_FRAME_CAPACITY,
    Limit,
    QuicConnection,
)
from aioquic.quic.packet import QuicFrameType
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.stream import QuicStream

from transport.h3.receive_budget import AddressShare

DEFAULT_STREAM_WINDOW = 1 << 20
DEFAULT_CONNECTION_WINDOW = 16 << 20
# A server's request streams start with this much credit (its transport parameters), and get
# their full window once their receive budget reserved it: a stream that cannot have it still
# runs within this one, so a burst of calls whose requests span several packets (the headers
# arrive before the end) reserves 64 KiB each until their end arrives, not a window each.
NARROW_STREAM_WINDOW = 64 << 10
# Full windows are granted while they keep an address's (and the total) reservations within
# this share of its budget; the rest is for narrow windows, 16 times as many streams.
WIDE_SHARE = 0.5
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

    With a budget (`use_budget`, the server), what the streams hold is bounded across
    connections too: a request stream is admitted only if its window (or, `admit`, its size or
    a narrow window) can be reserved from the budget of its peer's address, and gets no more
    credit than it reserved; a message larger than its window is promoted only once
    all of it (plus `FRAMING_SLACK`) is reserved; till then it waits, within its window, and
    the connection retries when another connection releases. A reservation shrinks as the
    stream's unused credit does (what it consumed, what it can no longer receive) and is
    released when the stream is stopped or forgotten. A stream's unused credit (its limit, or
    final size, minus what it consumed) never exceeds its reservation, so neither do the bytes
    it holds.
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
        self._share: AddressShare | None = None
        self._reserved: dict[int, int] = {}  # admitted stream -> bytes reserved for it
        self._base: dict[int, int] = {}  # admitted stream -> its window (unless promoted)
        bases = self._base
        self._on_credit: Callable[[], None] | None = None
        original_stream_limits = quic._write_stream_limits
        unconsumed = self._unconsumed
        stopped = self._stopped
        in_progress = self._in_progress
        half_window = stream_window // 2

        # Called for every stream in every packet aioquic builds: kept lean.
        def request_stream_limit(stream_id: int, stream: QuicStream) -> int | None:
            """The limit the next packet has for a request stream; None: it gets no credit
            (stopped, or one that receives nothing)."""
            local = stream.max_stream_data_local
            if not local or stream_id in stopped:
                return None
            need = in_progress.get(stream_id, 0)
            held = unconsumed.get(stream_id, 0)
            base = bases.get(stream_id, stream_window)
            window = need if need > base and stream_id == self._promoted else base
            batch = half_window if window >= stream_window else window // 2
            return credit_limit(
                local, stream.receiver.highest_offset, held, window, batch, held <= need
            )

        def write_stream_limits(
            conn: QuicConnection, builder: QuicPacketBuilder, space: object, stream: QuicStream
        ) -> None:
            stream_id = stream.stream_id
            if stream_id is None or stream_id & 2:
                original_stream_limits(builder, space, stream)  # type: ignore[arg-type]
                return
            local = request_stream_limit(stream_id, stream)
            if local is None:
                return
            stream.max_stream_data_local = local
            if stream.max_stream_data_local_sent != local:
                self._send_stream_credit(builder, stream)

        def write_connection_limits(
            conn: QuicConnection, builder: QuicPacketBuilder, space: object
        ) -> None:
            self._write_connection_credit(builder)

        self._request_stream_limit = request_stream_limit
        quic._write_stream_limits = types.MethodType(write_stream_limits, quic)  # type: ignore[method-assign]
        quic._write_connection_limits = types.MethodType(write_connection_limits, quic)  # type: ignore[method-assign]

    def use_budget(self, share: AddressShare, on_credit: Callable[[], None]) -> None:
        """Reserve what request streams may hold from `share`; `on_credit`: credit became due
        because a wait for the budget ended (send a packet)."""
        self._share = share
        self._on_credit = on_credit

    def admit(self, stream_id: int) -> bool:
        """A request stream opened: reserve its window, or all of it if its end already
        arrived (a unary call's request often comes whole in one packet: it reserves its size
        only), or, once windows take WIDE_SHARE of the budget, NARROW_STREAM_WINDOW (the
        credit it started with) and it keeps that window. False: the budget has no room even
        for that, the stream must be refused (nothing was reserved). A stream cannot wait
        instead: its peer already holds its first credit (the transport parameters gave it)."""
        if self._share is None:
            return True
        stream = self.quic._streams.get(stream_id)
        final_size = None if stream is None else stream.receiver._final_size
        if final_size is not None:
            size = min(final_size, self.stream_window)
        elif self._share.reserve(self.stream_window, WIDE_SHARE):
            self._reserved[stream_id] = self._base[stream_id] = self.stream_window
            return True
        else:
            size = min(NARROW_STREAM_WINDOW, self.stream_window)
        if not self._share.reserve(size):
            return False
        self._reserved[stream_id] = self._base[stream_id] = size
        return True

    def received(self, stream_id: int, size: int) -> None:
        """The stream now holds `size` more payload bytes nobody has consumed yet."""
        self._unconsumed[stream_id] += size
        self._total_unconsumed += size

    def consumed(self, stream_id: int, size: int) -> None:
        """The application took `size` bytes out of the stream: the peer may send more."""
        size = min(size, self._unconsumed.get(stream_id, 0))
        self._unconsumed[stream_id] -= size
        self._total_unconsumed -= size
        self.settle(stream_id)

    def message_in_progress(self, stream_id: int, size: int) -> None:
        """The stream is receiving a message of `size` bytes on the wire (0: none)."""
        if size:
            self._in_progress[stream_id] = size + FRAMING_SLACK
        else:
            self._in_progress.pop(stream_id, None)
        self._promote()
        self.settle(stream_id)

    def stop(self, stream_id: int) -> None:
        """Nobody reads this stream any more: no more credit for it, what it holds is freed."""
        if len(self._stopped) >= _PRUNE_STOPPED:
            self._stopped.intersection_update(self.quic._streams)  # those aioquic still has
        self._stopped.add(stream_id)
        self.forget(stream_id)

    def forget(self, stream_id: int) -> None:
        """The call is over; whatever it left unread no longer holds credit back (a stopped
        stream stays stopped while aioquic keeps it)."""
        self._in_progress.pop(stream_id, None)
        self._total_unconsumed -= self._unconsumed.pop(stream_id, 0)
        reserved = self._reserved.pop(stream_id, 0)
        self._base.pop(stream_id, None)
        self._promote()
        if self._share is not None:
            self._share.release(reserved)

    def close(self) -> None:
        """The connection is gone: whatever its streams reserved goes back to the budget."""
        if self._share is not None:
            self._share.stop_waiting(self)
            reserved = sum(self._reserved.values())
            self._reserved.clear()
            self._base.clear()
            self._share.release(reserved)

    def settle(self, stream_id: int) -> None:
        """Shrink the stream's reservation to what it may still come to hold: what it holds
        plus the credit it has not used, and, while the peer may send more, its window (or
        its promoted message) for the credit still to come."""
        reserved = self._reserved.get(stream_id)
        stream = self.quic._streams.get(stream_id)
        if reserved is None or stream is None or self._share is None:
            return
        receiver = stream.receiver
        final_size = receiver._final_size
        consumed = receiver.highest_offset - self._unconsumed.get(stream_id, 0)
        if final_size is None:
            limit = stream.max_stream_data_local
            promoted = self._in_progress.get(stream_id, 0) if stream_id == self._promoted else 0
            floor = max(self._base.get(stream_id, self.stream_window), promoted)
        else:
            limit, floor = final_size, 0
        keep = max(limit - consumed, floor)
        if keep < reserved:
            self._reserved[stream_id] = keep
            self._share.release(reserved - keep)

    def _promote(self) -> None:
        """Promote the oldest message in progress; with a budget, once all of it is
        reserved (else it waits for a release, and no message is promoted)."""
        candidate = next(iter(self._in_progress), None)
        share = self._share
        if candidate is not None and share is not None and candidate in self._reserved:
            extra = self._in_progress[candidate] - self._reserved[candidate]
            if extra > 0 and not share.reserve(extra):
                self._promoted = None
                share.wait(self, self._retry_promotion)
                return
            self._reserved[candidate] += max(0, extra)
        if share is not None:
            share.stop_waiting(self)
        self._promoted = candidate

    def _retry_promotion(self) -> None:
        self._promote()
        if self._promoted is not None and self._on_credit is not None:
            self._on_credit()

    def reserved(self) -> int:
        """Bytes this connection's streams reserved from the budget."""
        return sum(self._reserved.values())

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

    def due(self, stream_id: int) -> bool:
        """The next packet would carry credit for the stream or the connection: what the
        application just consumed is worth a packet now (most reads are not: credit is
        granted in batches)."""
        stream = self.quic._streams.get(stream_id)
        return (stream is not None and self.stream_due(stream)) or self.connection_due(0, 0)

    def stream_due(self, stream: QuicStream) -> bool:
        """The next packet would carry MAX_STREAM_DATA for `stream`."""
        stream_id = stream.stream_id
        local = stream.max_stream_data_local
        if stream_id is None or stream_id & 2:  # aioquic's rule (`_write_stream_limits`)
            return (bool(local) and stream.receiver.highest_offset * 2 > local) or (
                stream.max_stream_data_local_sent != local
            )
        limit = self._request_stream_limit(stream_id, stream)
        return limit is not None and limit != stream.max_stream_data_local_sent

    def connection_due(self, discarded_bidi: int, discarded_uni: int) -> bool:
        """The next packet would carry MAX_DATA, or MAX_STREAMS once aioquic discards that
        many finished streams the peer opened (each lets it open one more)."""
        quic = self.quic
        if self._connection_limit() != quic._local_max_data.sent:
            return True
        return _max_streams_due(
            quic._local_max_streams_bidi, quic._local_max_streams_bidi.value + discarded_bidi
        ) or _max_streams_due(
            quic._local_max_streams_uni, quic._local_max_streams_uni.value + discarded_uni
        )

    def _connection_limit(self) -> int:
        """The MAX_DATA limit the next packet has."""
        max_data = self.quic._local_max_data
        window = self.connection_window
        held = self._total_unconsumed
        if self._promoted is not None:
            window += self._in_progress[self._promoted]
            held = min(held, self.connection_window + self._unconsumed.get(self._promoted, 0))
        return credit_limit(
            max_data.value,
            max_data.used,
            held,
            window,
            self.connection_window // 2,
            True,  # whatever the streams hold, the peer is never kept from what it may send
        )

    def _write_connection_credit(self, builder: QuicPacketBuilder) -> None:
        quic = self.quic
        max_data = quic._local_max_data
        max_data.value = self._connection_limit()
        for limit in (max_data, quic._local_max_streams_bidi, quic._local_max_streams_uni):
            due = (
                limit.value != limit.sent
                if limit is max_data
                else _max_streams_due(limit, limit.value)
            )
            if due:
                buf = builder.start_frame(
                    limit.frame_type,
                    capacity=CONNECTION_LIMIT_FRAME_CAPACITY,
                    handler=quic._on_connection_limit_delivery,
                    handler_args=(limit,),
                )
                buf.push_uint_var(limit.value)
                limit.sent = limit.value


def _max_streams_due(limit: Limit, value: int) -> bool:
    """MAX_STREAMS raised to `value` goes out, batched as aioquic does: once the peer has
    fewer streams left to open than the raise would add."""
    return value != limit.sent and limit.sent - limit.used < value - limit.sent
