"""What a generated stub's method holds on a QuicChannel: a multicallable that starts one of
the four call kinds (a single message or a stream, each way)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Generator, Iterable
from typing import Any

from grpc.aio import EOF  # type: ignore[attr-defined]

from clients.quic_call import Call, CallChannel
from clients.trace_context import with_trace_context

Serializer = Callable[[Any], bytes] | None
Deserializer = Callable[[bytes], Any] | None
MetadataArg = Iterable[tuple[str, str | bytes]] | None


class MultiCallable:
    def __init__(
        self,
        channel: CallChannel,
        method: str,
        serializer: Serializer,
        deserializer: Deserializer,
        call_type: type[Call],
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


class UnaryUnaryCall(Call):
    def __await__(self) -> Generator[Any, None, Any]:
        return self._unary_response().__await__()


class _ResponseStream(Call):
    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while (message := await self._read()) is not EOF:
            yield message

    async def read(self) -> Any:
        return await self._read()


class UnaryStreamCall(_ResponseStream):
    pass


class StreamUnaryCall(Call):
    request_streaming = True

    def __await__(self) -> Generator[Any, None, Any]:
        return self._unary_response().__await__()


class StreamStreamCall(_ResponseStream):
    request_streaming = True
