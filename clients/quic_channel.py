"""A grpc.aio-compatible channel over HTTP/3 (QUIC), so generated stubs work unchanged:
`GRPCInferenceServiceStub(QuicChannel("localhost:8001", ca_file="certs/ca.pem"))`."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Generator, Iterable
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from aioquic.quic import events
from grpc.aio import EOF, AioRpcError, Metadata  # type: ignore[attr-defined]

from clients.tickets import SessionTicketCache
from clients.trace_context import with_trace_context
from transport.grpc import headers as wire
from transport.grpc.framing import encode_message
from transport.h3 import early_data
from transport.h3.client import DEFAULT_UNRESPONSIVE_S, H3ClientConnection, client_configuration
from transport.h3.early_data import DEFAULT_EARLY_DATA_METHODS
from transport.h3.settings import H3Settings
from transport.h3.stream import H3Stream
from transport.h3.stream_state import StreamClosed

Serializer = Callable[[Any], bytes] | None
Deserializer = Callable[[bytes], Any] | None
MetadataArg = Iterable[tuple[str, str | bytes]] | None
DEFAULT_PORT = 8001
CONNECT_ATTEMPTS = 3  # for calls without a deadline
MAX_ATTEMPTS = 5  # transparent retries of one call
MAX_BACKOFF_S = 5.0


def _split_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return target.strip("[]"), DEFAULT_PORT
    return host.strip("[]"), int(port)


class QuicChannel:
    """Connects lazily, reuses one connection for every call, and opens a new one after the
    old one died, idled out or the server sent GOAWAY. A server process killed mid-call sends
    nothing more: with calls in flight, `unresponsive_timeout_s` of silence (despite a PING)
    ends the connection, its calls fail with UNAVAILABLE and the next call reconnects (None:
    wait for the idle timeout).

    With a `ticket_cache` the channel resumes TLS sessions: a new connection that has a ticket
    sends its first calls (those in `early_data_methods`) as 0-RTT early data, with the
    handshake. Calls made while a connection is being (re)established wait for it, retrying
    with jittered exponential backoff, up to their deadline.

    `client_cert`/`client_key` (PEM) are offered to servers that ask for a client certificate
    (mutual TLS). A session ticket resumes the identity of the connection that received it, so
    the cache keeps tickets per client certificate.
    """

    def __init__(
        self,
        target: str,
        *,
        ca_file: str | None = None,
        server_name: str | None = None,
        settings: H3Settings | None = None,
        idle_timeout_s: float = 60.0,
        ticket_cache: SessionTicketCache | None = None,
        early_data_methods: frozenset[str] = DEFAULT_EARLY_DATA_METHODS,
        connect_timeout_s: float = 10.0,
        keepalive_s: float | None = None,
        ticket_wait_s: float = 1.0,
        client_cert: str | None = None,
        client_key: str | None = None,
        unresponsive_timeout_s: float | None = DEFAULT_UNRESPONSIVE_S,
    ) -> None:
        self.host, self.port = _split_target(target)
        self.authority = f"{self.host}:{self.port}" if ":" not in self.host else target
        self._ca_file = ca_file
        self._client_cert = client_cert
        self._client_key = client_key
        self._server_name = server_name or self.host
        chosen = settings or H3Settings()
        self._settings = replace(chosen, keepalive_s=keepalive_s or chosen.keepalive_s)
        self._idle_timeout_s = idle_timeout_s
        self._tickets = ticket_cache
        self._ticket_key = SessionTicketCache.key(
            self._server_name,
            self.host,
            self.port,
            Path(client_cert).read_bytes() if client_cert else b"",
        )
        self.early_data_methods = early_data_methods
        self._connect_timeout_s = connect_timeout_s
        self._ticket_wait_s = ticket_wait_s
        self._unresponsive_s = unresponsive_timeout_s
        self._connection: H3ClientConnection | None = None
        self._old: list[H3ClientConnection] = []
        self._lock = asyncio.Lock()
        self._closed = False
        self.last_connect_mode: str | None = None  # full, resumed, 0rtt-accepted, 0rtt-rejected

    async def connection(
        self, early: bool = False, deadline: float | None = None
    ) -> H3ClientConnection:
        """The current connection; `early` calls may use it before its handshake completes."""
        if self._closed:
            raise StreamClosed(grpc.StatusCode.CANCELLED, "the channel is closed")
        async with self._lock:
            if self._connection is None or not self._connection.usable:
                if self._connection is not None:
                    self._old.append(self._connection)
                    self._connection = None
                self._connection = await self._connect_with_backoff(deadline)
            connection = self._connection
        if early and connection.may_send_early:
            return connection
        await self._wait_handshake(connection, deadline)
        return connection

    async def _connect_with_backoff(self, deadline: float | None) -> H3ClientConnection:
        loop = asyncio.get_running_loop()
        delay, attempts = 0.05, 0
        while True:
            attempts += 1
            try:
                return await self._connect()
            except StreamClosed:
                remaining = None if deadline is None else deadline - loop.time()
                if (remaining is None and attempts >= CONNECT_ATTEMPTS) or (
                    remaining is not None and remaining <= delay
                ):
                    raise
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, MAX_BACKOFF_S)

    async def _connect(self) -> H3ClientConnection:
        ticket = self._tickets.take(self._ticket_key) if self._tickets else None
        configuration = client_configuration(
            self._server_name,
            self._ca_file,
            ticket,
            self._idle_timeout_s,
            self._settings,
            self._client_cert,
            self._client_key,
        )
        tickets = self._tickets
        key = self._ticket_key
        try:
            connection = await H3ClientConnection.connect(
                self.host,
                self.port,
                configuration,
                self._settings,
                session_ticket_handler=(lambda t: tickets.add(key, t))
                if tickets is not None
                else None,
                unresponsive_s=self._unresponsive_s,
            )
        except OSError as exc:
            raise self._unavailable(exc) from exc
        connection.protocol.handshake.add_done_callback(
            lambda done: self._record_mode(connection, done)
        )
        return connection

    async def _wait_handshake(self, connection: H3ClientConnection, deadline: float | None) -> None:
        timeout = self._connect_timeout_s
        if deadline is not None:
            timeout = min(timeout, max(deadline - asyncio.get_running_loop().time(), 0.0))
        try:
            await asyncio.wait_for(connection.wait_connected(), timeout)
        except TimeoutError:
            await self._drop(connection)
            raise StreamClosed(
                grpc.StatusCode.UNAVAILABLE,
                f"no HTTP/3 handshake with {self.authority} within {timeout:.1f} s",
            ) from None
        except ConnectionError as exc:
            await self._drop(connection)
            raise self._unavailable(exc) from exc

    async def _drop(self, connection: H3ClientConnection) -> None:
        if self._connection is connection:
            self._connection = None
        await connection.close()

    def _unavailable(self, exc: BaseException) -> StreamClosed:
        return StreamClosed(
            grpc.StatusCode.UNAVAILABLE,
            f"failed to connect to {self.authority} over HTTP/3: {exc or type(exc).__name__}",
        )

    def _record_mode(
        self, connection: H3ClientConnection, done: asyncio.Future[events.HandshakeCompleted]
    ) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        event = done.result()
        if event.early_data_accepted:
            self.last_connect_mode = "0rtt-accepted"
        elif connection.sent_early:
            self.last_connect_mode = "0rtt-rejected"
        else:
            self.last_connect_mode = "resumed" if event.session_resumed else "full"

    async def channel_ready(self) -> None:
        await self.connection()

    async def close(self, grace: float | None = None) -> None:
        """Close every connection; first wait briefly for a session ticket the server has not
        sent yet, so the next connection can resume (it arrives about one RTT after the
        handshake)."""
        self._closed = True
        current = self._connection
        if self._tickets is not None and current is not None and current.handshake_succeeded:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(current.ticket_received.wait(), self._ticket_wait_s)
        for connection in [*self._old, *([current] if current else [])]:
            await connection.close()
        self._connection = None
        self._old.clear()

    async def __aenter__(self) -> QuicChannel:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def unary_unary(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
    ) -> _MultiCallable:
        return _MultiCallable(
            self, method, request_serializer, response_deserializer, UnaryUnaryCall
        )

    def unary_stream(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
    ) -> _MultiCallable:
        return _MultiCallable(
            self, method, request_serializer, response_deserializer, UnaryStreamCall
        )

    def stream_unary(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
    ) -> _MultiCallable:
        return _MultiCallable(
            self, method, request_serializer, response_deserializer, StreamUnaryCall
        )

    def stream_stream(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
    ) -> _MultiCallable:
        return _MultiCallable(
            self, method, request_serializer, response_deserializer, StreamStreamCall
        )


class _MultiCallable:
    def __init__(
        self,
        channel: QuicChannel,
        method: str,
        serializer: Serializer,
        deserializer: Deserializer,
        call_type: type[_Call],
    ) -> None:
        self._channel = channel
        self._method = method
        self._serializer = serializer or (lambda m: m)
        self._deserializer = deserializer or (lambda b: b)
        self._call_type = call_type

    def __call__(
        self,
        request: Any = None,
        *,
        timeout: float | None = None,
        metadata: MetadataArg = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        return self._call_type(
            self._channel,
            self._method,
            self._serializer,
            self._deserializer,
            request,
            timeout,
            with_trace_context(metadata or ()),
            bool(wait_for_ready),
        )


class _Call:
    """State shared by the four call kinds: one HTTP/3 request stream."""

    request_streaming = False

    def __init__(
        self,
        channel: QuicChannel,
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
        await asyncio.sleep(min(0.05 * 2**self._attempts, MAX_BACKOFF_S) * random.uniform(0.5, 1.5))
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
            raise AioRpcError(
                grpc.StatusCode.INTERNAL,
                self._initial or Metadata(),
                Metadata(),
                "the server sent no response message",
                None,
            )
        extra = await self._read()
        if extra is not EOF:
            raise AioRpcError(
                grpc.StatusCode.INTERNAL,
                self._initial or Metadata(),
                Metadata(),
                "the server sent more than one response message",
                None,
            )
        return response

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


class UnaryUnaryCall(_Call):
    def __await__(self) -> Generator[Any, None, Any]:
        return self._unary_response().__await__()


class _ResponseStream(_Call):
    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while (message := await self._read()) is not EOF:
            yield message

    async def read(self) -> Any:
        return await self._read()


class UnaryStreamCall(_ResponseStream):
    pass


class StreamUnaryCall(_Call):
    request_streaming = True

    def __await__(self) -> Generator[Any, None, Any]:
        return self._unary_response().__await__()


class StreamStreamCall(_ResponseStream):
    request_streaming = True
