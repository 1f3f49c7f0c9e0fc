"""One HTTP/3 request stream as a call sees it: what it received (a `StreamState`), waiters,
and what it sends, with backpressure."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from transport.grpc.status import H3_NO_ERROR, H3_REQUEST_CANCELLED
from transport.h3.aioquic.credit import ReceiveCredit
from transport.h3.settings import H3Settings
from transport.h3.stream_state import Headers, StreamClosed, StreamState


class StreamConnection(Protocol):
    """What a stream, and the call holding it, use of its connection
    (`transport.h3.protocol.GrpcH3Protocol`)."""

    settings: H3Settings
    credit: ReceiveCredit
    answers_malformed: bool

    def wake_senders(self) -> None: ...

    def stop_receiving(self, stream_id: int, error_code: int = ...) -> None: ...

    def transmit_soon(self) -> None: ...

    async def wait_send_window(self, stream: H3Stream) -> None: ...

    def h3_send_data(self, stream_id: int, data: bytes, end: bool) -> None: ...

    def h3_send_headers(self, stream_id: int, headers: Headers, end: bool) -> None: ...

    def reset(self, stream_id: int, error_code: int = ...) -> None: ...

    def forget(self, stream_id: int) -> None: ...

    def peer_max_field_section(self) -> int | None: ...


class H3Stream:
    """One request stream: its `StreamState`, waiters, outgoing data with backpressure."""

    def __init__(self, protocol: StreamConnection, stream_id: int) -> None:
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
        self.headers_at: float | None = None  # time.monotonic() when the headers arrived

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
        if self.headers_at is None:
            self.headers_at = time.monotonic()
        self.state.headers_received(headers, ended)
        if self.state.error is not None:
            self._failed()
        elif ended:
            self.protocol.credit.settle(self.stream_id)
        if self.on_headers is not None:
            self.on_headers()
        self._changed.set()

    def data_received(self, data: bytes, ended: bool) -> None:
        if self.state.data_received(data, ended):
            self._sync_credit()
            if ended:  # the peer can send no more: its stream reserves only what it holds
                self.protocol.credit.settle(self.stream_id)
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
            if self.protocol.credit.due(self.stream_id):
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

    async def wait_failed(self) -> StreamClosed:
        """Until the stream fails: reset or stopped by the peer, or its connection lost."""
        while self.error is None:
            self._changed.clear()
            await self._changed.wait()
        return self.error

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
