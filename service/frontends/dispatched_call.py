"""One call a front-end passed on, run in the parent (dispatch.py gets its frames): the
handler its transport table names, driven as the transports drive theirs, with a servicer
context over the call's frames, its deadline, and its status at the end."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc
from grpc.aio import EOF, AbortError  # type: ignore[attr-defined]

from service.frontends.described_call import oversized
from service.frontends.link import Inbox, Window
from service.frontends.protocol import (
    PART,
    Kind,
    Open,
    ProtocolViolation,
    Status,
    decode_count,
    encode_metadata,
)
from service.inference.errors import ServiceError
from service.observability.observer import deadline_passed
from transport.grpc.handler_table import HandlerTable, run_behavior
from transport.grpc.servicer_context import CallContext
from transport.h3.calls import TransportAnswer

log = logging.getLogger("paddlequic.frontends")

TRANSPORTS = ("h2", "h3")


def transport_of(opened: Open) -> str:
    """The transport the call came on (h2 or h3), for a stream's part too."""
    return opened.transport.removesuffix(PART)


class CallServer(Protocol):
    """What a call uses of the dispatch server."""

    max_message: int
    tables: dict[str, HandlerTable]
    answered: Callable[[str, TransportAnswer], None] | None


class CallLink(Protocol):
    """What a call uses of its front-end's connection."""

    @property
    def server(self) -> CallServer: ...

    def send(self, kind: Kind, call_id: int, payload: bytes = b"") -> None: ...

    def give_credit(self, call_id: int, count: int = 1) -> None: ...

    async def drain(self) -> None: ...


class DispatchedCall:
    def __init__(self, link: CallLink, call_id: int, opened: Open) -> None:
        self.link = link
        self.call_id = call_id
        self.opened = opened
        self.inbox = Inbox(link, call_id)
        self.window = Window()
        self.cancelled = False
        self.context: DispatchContext | None = None
        self.task: asyncio.Task[None] | None = None
        self.invoked = False  # whether its handler's behavior ran
        self._started = time.perf_counter()
        self._deadline = (
            None if opened.timeout is None else asyncio.get_running_loop().time() + opened.timeout
        )

    def received(self, kind: Kind, payload: bytes) -> None:
        if kind is Kind.MESSAGE:
            self.inbox.put(payload)
        elif kind is Kind.HALF_CLOSE:
            self.inbox.put(None)
        elif kind is Kind.CREDIT:
            self.window.give(decode_count(payload))
        elif kind is Kind.CANCEL:
            self.cancel()
        else:
            raise ProtocolViolation(f"{kind.name} frame from a front-end")

    def cancel(self) -> None:
        """The client is gone (or its front-end): the handler stops, nobody reads an answer."""
        self.cancelled = True
        if self.context is not None:
            self.context.mark_cancelled()
        if self.task is not None:
            self.task.cancel()

    async def run(self) -> Status:
        status = await self._run()
        answered = self.link.server.answered
        if not self.invoked and answered is not None and self.opened.transport in TRANSPORTS:
            self._observe(answered, status)
        return status

    def _observe(self, answered: Callable[[str, TransportAnswer], None], status: Status) -> None:
        """A call that ended before its behavior ran, observed as its transport would: a
        client's cancel that close to its deadline is the deadline."""
        code = status.code
        now = asyncio.get_running_loop().time()
        remaining = None if self._deadline is None else self._deadline - now
        if deadline_passed(remaining, code is grpc.StatusCode.CANCELLED):
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        method = self.opened.method
        table = self.link.server.tables[self.opened.transport]
        seconds = time.perf_counter() - self._started
        answer = TransportAnswer(method, table.registered(method), code, status.details, seconds)
        answered(self.opened.transport, answer)

    async def _run(self) -> Status:
        opened = self.opened
        table = self.link.server.tables.get(opened.transport)
        handler = table.lookup(opened.method, opened.metadata) if table is not None else None
        if handler is None:
            return Status(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {opened.method}", ())
        timer = asyncio.timeout_at(self._deadline)
        status = await self._outcome(handler, timer)
        if timer.expired() and status.code is not grpc.StatusCode.DEADLINE_EXCEEDED:
            # A handler that outlived its cancel at the deadline and answered anyway: the call
            # ended at its deadline, as grpc.aio ends it (the answer would reach a client
            # whose own deadline timer is late, on a loaded host).
            return Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ())
        return status

    async def _outcome(
        self, handler: grpc.RpcMethodHandler[Any, Any], timer: asyncio.Timeout
    ) -> Status:
        opened = self.opened
        context = self.context = DispatchContext(self, handler)
        try:
            async with timer:
                request = await _request(handler, context)
                self.invoked = True
                await run_behavior(handler, request, context)
        except TimeoutError:
            context.mark_cancelled()
            return Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ())
        except AbortError:
            pass
        except ServiceError as exc:
            return Status(exc.code, exc.message, ())
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not self.cancelled or current is None:
                raise
            current.uncancel()
            return Status(grpc.StatusCode.CANCELLED, "Cancelled", ())
        except Exception as exc:
            log.exception("unexpected error in %s", opened.method)
            return Status(grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}", ())
        finally:
            context.finish()
        return Status(*context.final_status())


async def _request(handler: grpc.RpcMethodHandler[Any, Any], context: DispatchContext) -> Any:
    """The request iterator of a streaming method; the one message of a unary one."""
    if handler.request_streaming:
        return context.request_iterator()
    data = await context.call.inbox.get()
    if data is None:
        raise ServiceError(grpc.StatusCode.INTERNAL, "request ended without a message")
    if await context.call.inbox.get() is not None:
        raise ServiceError(
            grpc.StatusCode.INTERNAL, "received more than one message for a unary request"
        )
    return _deserialize(handler.request_deserializer, data)


def _deserialize(deserializer: Callable[[bytes], Any] | None, data: bytes) -> Any:
    if deserializer is None:
        return data
    try:
        return deserializer(data)
    except Exception as exc:
        raise ServiceError(
            grpc.StatusCode.INTERNAL, f"failed to parse the request message: {exc}"
        ) from exc


class DispatchContext(CallContext):
    """A call passed on by a front-end, for the servicer as grpc.aio's context is."""

    def __init__(self, call: DispatchedCall, handler: grpc.RpcMethodHandler[Any, Any]) -> None:
        opened = call.opened
        super().__init__(
            opened.method,
            opened.metadata,
            opened.timeout,
            opened.peer,
            handler.response_serializer,
            handler.request_deserializer,
        )
        self.call = call
        self.datagram_peer = transport_of(opened) == "h3"

    def peer_identities(self) -> list[bytes] | None:  # type: ignore[override]
        """The client certificate's identities, as the front-end's TLS saw them."""
        identity = self.call.opened.identity
        return list(identity[1:]) if identity else None

    def peer_identity_key(self) -> str | None:  # type: ignore[override]
        identity = self.call.opened.identity
        return identity[0].decode() if identity else None

    def auth_context(self) -> dict[str, list[bytes]]:
        """The front-end transport's, for a call passed on as a stream (else empty)."""
        return {name: list(values) for name, values in self.call.opened.auth}

    async def read(self) -> Any:
        data = await self.call.inbox.get()
        return EOF if data is None else _deserialize(self._deserialize, data)

    async def write(self, message: Any) -> None:
        data = self._serialize(message)
        limit = self.call.link.server.max_message
        if len(data) > limit:
            error = oversized(len(data), limit)
            await self.abort(error.code, error.message)
        if not self.headers_sent:
            self._send_headers(())
        await self.call.window.take()
        self.call.link.send(Kind.MESSAGE, self.call.call_id, data)
        await self.call.link.drain()

    def _send_headers(self, metadata: Sequence[tuple[str, Any]]) -> None:
        self.headers_sent = True
        self.call.link.send(Kind.HEADERS, self.call.call_id, encode_metadata(metadata))
