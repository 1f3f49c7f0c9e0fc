"""A servicer context for calls arriving over HTTP/3 that behaves like
grpc.aio.ServicerContext, so one servicer object serves both transports."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc.aio import EOF  # type: ignore[attr-defined]

from transport.grpc import headers as wire
from transport.grpc.framing import encode_message
from transport.grpc.metadata import Metadata
from transport.grpc.servicer_context import CallContext
from transport.h3.stream import H3Stream
from transport.tls.peer_auth import PeerAuth


class H3ServicerContext(CallContext):
    datagram_peer = True

    def __init__(
        self,
        stream: H3Stream,
        method: str,
        metadata: Metadata,
        timeout: float | None,
        peer: str,
        response_serializer: Callable[[Any], bytes] | None,
        request_deserializer: Callable[[bytes], Any] | None,
        auth: PeerAuth,
    ) -> None:
        super().__init__(method, metadata, timeout, peer, response_serializer, request_deserializer)
        self._stream = stream
        self._auth = auth
        self.invoked = False  # the handler's behavior runs: it answers for the call

    def peer_identities(self) -> list[bytes] | None:  # type: ignore[override]
        return self._auth.identities()

    def peer_identity_key(self) -> str | None:  # type: ignore[override]
        return self._auth.identity_key()

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth.auth_context()

    async def read(self) -> Any:
        data = await self._stream.read_message()
        return EOF if data is None else self._deserialize(data)

    async def write(self, message: Any) -> None:
        data = self._serialize(message)
        if len(data) > self._stream.protocol.settings.max_message:
            await self.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"response message of {len(data)} bytes exceeds the limit of "
                f"{self._stream.protocol.settings.max_message} bytes",
            )
        if not self.headers_sent:
            self._send_headers(())
        await self._stream.send_data(encode_message(data))

    def _send_headers(self, metadata: Sequence[tuple[str, Any]]) -> None:
        self.headers_sent = True
        self._stream.send_headers(wire.response_headers(metadata))
