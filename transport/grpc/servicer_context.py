"""What a servicer context is, apart from how messages travel: grpc.aio.ServicerContext's
status, metadata, deadline and callbacks, for servers of our own (HTTP/3, the front-ends'
dispatch endpoint), so one servicer object serves every transport."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import grpc
from grpc.aio import EOF, AbortError  # type: ignore[attr-defined]

from transport.grpc.metadata import Metadata


class CallContext:
    """Subclasses move the messages: `read`, `write`, `_send_headers`."""

    # Whether the peer's socket is UDP (HTTP/3) rather than TCP: who owns it is looked up in
    # the kernel's table of that protocol.
    datagram_peer = False

    def __init__(
        self,
        method: str,
        metadata: Metadata,
        timeout: float | None,
        peer: str,
        response_serializer: Callable[[Any], bytes] | None,
        request_deserializer: Callable[[bytes], Any] | None,
    ) -> None:
        self.method_path = method
        self._metadata = metadata
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._peer = peer
        self._serialize = response_serializer or (lambda m: m)
        self._deserialize = request_deserializer or (lambda b: b)
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: Metadata = ()
        self.headers_sent = False
        self._cancelled = False
        self._done = False
        self._callbacks: list[Callable[[Any], None]] = []

    # grpc.aio.ServicerContext

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, Any]]) -> None:
        if self.headers_sent:
            raise RuntimeError("initial metadata was already sent")
        self._send_headers(initial_metadata)

    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, Any]]) -> None:
        self._trailing = tuple(trailing_metadata)

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, Any]] = (),
    ) -> NoReturn:
        if code == grpc.StatusCode.OK:
            raise ValueError("abort() needs a non-OK status code")
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise AbortError()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._done:
            callback(self)
        else:
            self._callbacks.append(callback)

    def peer(self) -> str:
        return self._peer

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def set_compression(self, compression: grpc.Compression) -> None:
        """Responses are never compressed; accepted for API compatibility."""

    def disable_next_message_compression(self) -> None:
        """Responses are never compressed; accepted for API compatibility."""

    async def read(self) -> Any:
        raise NotImplementedError

    async def write(self, message: Any) -> None:
        raise NotImplementedError

    # used by the server

    def _send_headers(self, metadata: Sequence[tuple[str, Any]]) -> None:
        raise NotImplementedError

    def mark_cancelled(self) -> None:
        self._cancelled = True

    def finish(self) -> None:
        self._done = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def final_status(self) -> tuple[grpc.StatusCode, str, Metadata]:
        return self._code or grpc.StatusCode.OK, self._details, self._trailing

    def request_iterator(self) -> Any:
        async def iterate() -> Any:
            while (message := await self.read()) is not EOF:
                yield message

        return iterate()
