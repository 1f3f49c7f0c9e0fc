"""One gRPC call over a QuicChannel: its HTTP/3 request stream, sending, receiving, transparent
retries and the grpc.aio.Call surface, shared by the four call kinds."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from typing import Any, Protocol

import grpc
from grpc.aio import EOF, AioRpcError, Metadata  # type: ignore[attr-defined]

from clients.backoff import backoff_delay, jittered
from transport.grpc import headers as wire
from transport.grpc.framing import encode_message
from transport.h3 import early_data
from transport.h3.client import H3ClientConnection
from transport.h3.stream import H3Stream
from transport.h3.stream_state import StreamClosed

MAX_ATTEMPTS = 5  # transparent retries of one call
_RANDOM = random.Random()  # the retry jitter


class CallChannel(Protocol):
    """What a call needs of its channel (a QuicChannel)."""

    authority: str
    early_data_methods: frozenset[str]

    async def connection(
        self, early: bool = False, deadline: float | None = None
    ) -> H3ClientConnection: ...


class Call:
    """State shared by the four call kinds: one HTTP/3 request stream."""

    request_streaming = False

    def __init__(
        self,
        channel: CallChannel,
        method: str,
        serializer: Callable[[Any], bytes],
        deserializer: Callable[[bytes], Any],
        request: Any,
        timeout: float | None,
        metadata: tuple[tuple[str, str | bytes], ...],
        wait_for_ready: bool = False,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._channel = channel
        self._request = request
        self._wait_for_ready = wait_for_ready
        self._attempts = 1
        self._method = method
        self._serialize = serializer
        self._deserialize = deserializer
        self._deadline = None if timeout is None else loop.time() + timeout
        self._metadata = metadata
        self._stream: H3Stream | None = None
        self._initial: Metadata | None = None
        self._status: tuple[grpc.StatusCode, str, Metadata] | None = None
        self._callbacks: list[Callable[[Any], None]] = []
        self._cancel_requested = False
        self._locally_cancelled = False
        self._timer = (
            loop.call_at(self._deadline, self._expire) if self._deadline is not None else None
        )
        self._started: asyncio.Task[H3Stream] = loop.create_task(self._start())
        self._writer: asyncio.Task[None] | None = None
        if self.request_streaming and request is not None:
            self._writer = loop.create_task(self._write_all(request))

    # stream set-up and teardown

    async def _start(self) -> H3Stream:
        early = early_data.allowed(self._method, self._channel.early_data_methods)
        try:
            stream = await self._open_stream(early)
        except StreamClosed as exc:
            self._finish(exc.status, exc.message, Metadata())
            raise
        self._stream = stream
        if self._cancel_requested:
            stream.cancel()
        remaining = None if self._deadline is None else self._remaining()
        headers = wire.request_headers(
            self._channel.authority, self._method, remaining, self._metadata
        )
        limit = stream.protocol.peer_max_field_section()
        size = wire.field_section_size(headers)
        if limit is not None and size > limit:
            # The server would refuse it; before its SETTINGS arrive, it does so itself.
            stream.cancel()
            error = StreamClosed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request metadata of {size} bytes exceeds the server's limit of {limit} "
                "bytes (SETTINGS_MAX_FIELD_SECTION_SIZE)",
            )
            self._finish(error.status, error.message, Metadata())
            raise error
        stream.send_headers(headers)
        if not self.request_streaming:
            # Headers and the one message leave together, usually in one packet.
            with contextlib.suppress(StreamClosed):
                await stream.send_data(encode_message(self._serialize(self._request)), end=True)
        return stream

    async def _open_stream(self, early: bool) -> H3Stream:
        """A stream on a live connection. The connection can die between being handed out and
        the stream opening (its close was still in flight); nothing was sent yet, so take the
        channel's next one."""
        for _ in range(MAX_ATTEMPTS - 1):
            connection = await self._channel.connection(early, self._deadline)
            try:
                return connection.open_stream()
            except StreamClosed:
                continue
        return (await self._channel.connection(early, self._deadline)).open_stream()

    def _remaining(self) -> float:
        assert self._deadline is not None
        return max(self._deadline - asyncio.get_running_loop().time(), 0.0)

    def _expire(self) -> None:
        if self._status is None:
            self._finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", Metadata())
            self._abandon_stream()

    def _abandon_stream(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream.protocol.forget(self._stream.stream_id)
        else:
            self._cancel_requested = True

    def _finish(self, code: grpc.StatusCode, details: str, trailing: Metadata) -> None:
        if self._status is not None:
            return
        self._status = (code, details, trailing)
        if self._timer is not None:
            self._timer.cancel()
        if self._stream is not None:
            # Whatever the status, the connection no longer routes events to this call.
            self._stream.protocol.forget(self._stream.stream_id)
        for callback in self._callbacks:
            callback(self)

    def _error(self) -> AioRpcError | asyncio.CancelledError:
        """What using a finished, failed call raises: like grpc.aio, asyncio.CancelledError
        once the application cancelled it, AioRpcError otherwise."""
        if self._locally_cancelled:
            return asyncio.CancelledError()
        assert self._status is not None
        code, details, trailing = self._status
        return AioRpcError(code, self._initial or Metadata(), trailing, details, None)

    async def _stream_ready(self) -> H3Stream:
        try:
            return await asyncio.shield(self._started)
        except StreamClosed:
            raise self._error() from None

    # sending

    async def _write_all(self, requests: Any) -> None:
        with contextlib.suppress(StreamClosed, AioRpcError):
            if hasattr(requests, "__aiter__"):
                async for request in requests:
                    await self.write(request)
            else:
                for request in requests:
                    await self.write(request)
            await self.done_writing()

    async def write(self, request: Any) -> None:
        stream = await self._stream_ready()
        if self._status is not None:
            raise self._error()
        try:
            await stream.send_data(encode_message(self._serialize(request)))
        except StreamClosed:
            await self._receive_status()
            raise self._error() from None

    async def done_writing(self) -> None:
        stream = await self._stream_ready()
        with contextlib.suppress(StreamClosed):
            await stream.send_data(b"", end=True)

    # receiving

    async def _headers(self) -> Metadata | None:
        """Response headers; None when the call already has its status."""
        if self._initial is not None:
            return self._initial
        stream = await self._stream_ready()
        while True:
            try:
                headers = await stream.wait_headers()
                break
            except StreamClosed as exc:
                if not self._may_retry(exc):
                    self._finish(exc.status, exc.message, Metadata())
                    return None
                stream = await self._retry(stream)
        if wire.is_trailers_only(headers):
            status = wire.parse_trailers(headers)
            self._initial = Metadata()
            self._finish(status.code, status.message, Metadata(*status.metadata))
            return None
        head = wire.parse_response_headers(headers)
        if isinstance(head, wire.Status):
            self._initial = Metadata()
            self._finish(head.code, head.message, Metadata(*head.metadata))
            return None
        self._initial = Metadata(*head.metadata)
        return self._initial

    def _may_retry(self, error: StreamClosed) -> bool:
        """gRPC's transparent retry: a unary request that the server refused unprocessed (or any
        UNAVAILABLE one with wait_for_ready) is sent again on a fresh stream, until the
        deadline."""
        return (
            not self.request_streaming
            and self._status is None
            and error.status == grpc.StatusCode.UNAVAILABLE
            and (error.refused or self._wait_for_ready)
            and self._attempts < MAX_ATTEMPTS
            and (self._deadline is None or self._remaining() > 0)
        )

    async def _retry(self, failed: H3Stream) -> H3Stream:
        self._attempts += 1
        failed.protocol.forget(failed.stream_id)
        await asyncio.sleep(jittered(backoff_delay(self._attempts), _RANDOM))
        self._started = asyncio.get_running_loop().create_task(self._start())
        return await self._stream_ready()

    async def _read(self) -> Any:
        """The next response message, or EOF once the status is known and OK."""
        if self._status is None and await self._headers() is not None:
            assert self._stream is not None
            try:
                data = await self._stream.read_message()
            except StreamClosed as exc:
                self._finish(exc.status, exc.message, Metadata())
            else:
                if data is not None:
                    return self._deserialize(data)
                await self._receive_status()
        assert self._status is not None
        if self._status[0] != grpc.StatusCode.OK:
            raise self._error()
        return EOF

    async def _receive_status(self) -> None:
        if self._status is not None or self._stream is None:
            return
        try:
            await self._stream.wait_closed()
        except StreamClosed as exc:
            self._finish(exc.status, exc.message, Metadata())
            return
        if self._stream.error is not None:
            self._finish(self._stream.error.status, self._stream.error.message, Metadata())
        elif self._stream.trailers is None:
            self._finish(grpc.StatusCode.INTERNAL, "the server sent no trailers", Metadata())
        else:
            status = wire.parse_trailers(self._stream.trailers)
            self._finish(status.code, status.message, Metadata(*status.metadata))

    async def _unary_response(self) -> Any:
        response = await self._read()
        if response is EOF:
            raise self._internal("the server sent no response message")
        extra = await self._read()
        if extra is not EOF:
            raise self._internal("the server sent more than one response message")
        return response

    def _internal(self, details: str) -> AioRpcError:
        return AioRpcError(
            grpc.StatusCode.INTERNAL, self._initial or Metadata(), Metadata(), details, None
        )

    # grpc.aio.Call

    def cancel(self) -> bool:
        if self._status is not None:
            return False
        self._locally_cancelled = True
        self._finish(grpc.StatusCode.CANCELLED, "Locally cancelled by application!", Metadata())
        self._abandon_stream()
        return True

    def cancelled(self) -> bool:
        return self._status is not None and self._status[0] == grpc.StatusCode.CANCELLED

    def done(self) -> bool:
        return self._status is not None

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else self._remaining()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._status is not None:
            callback(self)
        else:
            self._callbacks.append(callback)

    async def initial_metadata(self) -> Metadata:
        await self._headers()
        return self._initial or Metadata()

    async def trailing_metadata(self) -> Metadata:
        await self._wait_status()
        assert self._status is not None
        return self._status[2]

    async def code(self) -> grpc.StatusCode:
        await self._wait_status()
        assert self._status is not None
        return self._status[0]

    async def details(self) -> str:
        await self._wait_status()
        assert self._status is not None
        return self._status[1]

    async def wait_for_connection(self) -> None:
        await self._stream_ready()

    async def _wait_status(self) -> None:
        while self._status is None:
            try:
                if await self._read() is EOF:
                    return
            except AioRpcError:
                return
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not self._locally_cancelled or (task is not None and task.cancelling()):
                    raise
                return
