"""A grpc.aio-compatible channel over HTTP/3 (QUIC), so generated stubs work unchanged:
`GRPCInferenceServiceStub(QuicChannel("localhost:8001", ca_file="certs/ca.pem"))`."""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import replace
from pathlib import Path
from types import TracebackType

import grpc
from aioquic.quic import events

from clients.backoff import backoff_delay, jittered
from clients.quic_multicallable import (
    Deserializer,
    MultiCallable,
    Serializer,
    StreamStreamCall,
    StreamUnaryCall,
    UnaryStreamCall,
    UnaryUnaryCall,
)
from clients.tickets import SessionTicketCache
from transport.h3.client import DEFAULT_UNRESPONSIVE_S, H3ClientConnection, client_configuration
from transport.h3.early_data import DEFAULT_EARLY_DATA_METHODS
from transport.h3.settings import H3Settings
from transport.h3.stream_state import StreamClosed

DEFAULT_PORT = 8001
CONNECT_ATTEMPTS = 3  # for calls without a deadline


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
    handshake; the server's address token, kept there too, spares it a QUIC Retry. Calls made
    while a connection is being (re)established wait for it, retrying with jittered
    exponential backoff, up to their deadline.

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
        self._random = random.Random()  # the reconnect jitter
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
        attempts = 0
        while True:
            delay = backoff_delay(attempts)
            attempts += 1
            try:
                return await self._connect()
            except StreamClosed:
                remaining = None if deadline is None else deadline - loop.time()
                if (remaining is None and attempts >= CONNECT_ATTEMPTS) or (
                    remaining is not None and remaining <= delay
                ):
                    raise
            await asyncio.sleep(jittered(delay, self._random))

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
            self._tickets.take_token(self._ticket_key) if self._tickets else b"",
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
                token_handler=(lambda t: tickets.add_token(key, t))
                if tickets is not None
                else None,
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

    @property
    def connected(self) -> bool:
        """A connection whose handshake completed is open and takes new calls."""
        connection = self._connection
        return connection is not None and connection.usable and connection.handshake_succeeded

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

    # grpc.aio.Channel's four kinds of method, as the generated stubs ask for them (typed one by
    # one so that mypy checks the stubs' calls).
    def unary_unary(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
    ) -> MultiCallable:
        return MultiCallable(
            self, method, request_serializer, response_deserializer, UnaryUnaryCall
        )

    def unary_stream(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
    ) -> MultiCallable:
        return MultiCallable(
            self, method, request_serializer, response_deserializer, UnaryStreamCall
        )

    def stream_unary(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
    ) -> MultiCallable:
        return MultiCallable(
            self, method, request_serializer, response_deserializer, StreamUnaryCall
        )

    def stream_stream(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
    ) -> MultiCallable:
        return MultiCallable(
            self, method, request_serializer, response_deserializer, StreamStreamCall
        )
