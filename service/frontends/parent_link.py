"""A front-end's end of its dispatch connection to the parent (`ParentLink`): what it does
with each call. ModelInfer on a version it queues for itself it serves (served_here.py); on
another version the parent described, it passes on as a descriptor it decoded and validated
(model_view.py); ModelStreamInfer it holds itself when it queues for itself (stream_here.py,
which passes on the requests it cannot run in one stream of the parent's); every other call it
passes on as its message bytes, unparsed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from service.api.restricted import Restriction
from service.api.shared_memory import GrpcSharedMemory
from service.frontends.described_call import Serving
from service.frontends.descriptors import (
    MODEL_INFER,
    Refusal,
    ViewEntry,
    decode_view,
    encode_infer,
    encode_refusal,
)
from service.frontends.host_limits import RpcCount
from service.frontends.link import FrameConnection, Window
from service.frontends.local_counts import LocalCounts
from service.frontends.model_view import ModelView, answer_message
from service.frontends.placed_here import PlacedTensors
from service.frontends.protocol import (
    WINDOW,
    Frame,
    Kind,
    Open,
    ProtocolViolation,
    Status,
    auth_of,
    decode_count,
    decode_metadata,
    decode_methods,
    decode_status,
    encode_count,
    encode_open,
    opened_of,
)
from service.frontends.report_sender import ReportSender
from service.frontends.reports import ReportFrames
from service.frontends.served_here import ServedHere, serve_here
from service.frontends.shared_versions import SharedVersions
from service.frontends.stream_here import StreamHere
from service.inference.credit import ReturnedCredit
from service.observability.metrics import Metrics
from transport.h3.server import H3Server

# The call's end when the parent never sent one: the parent is gone, or the client left first.
_GONE = Status(grpc.StatusCode.UNAVAILABLE, "this front-end lost its server process", ())


Sink = Callable[[Kind, Any], None]


class _Forwarded:
    """One call passed on: what the parent sent back for it, in order, queued for the task
    that reads it, or given to its `sink` as it comes."""

    def __init__(self, sink: Sink | None = None) -> None:
        self.events: asyncio.Queue[tuple[Kind, Any]] = asyncio.Queue()
        self.sink = sink
        self.window = Window()
        self.credit = ReturnedCredit(WINDOW)  # for the parent's messages the client took
        self.unread = 0  # the parent's messages not taken yet
        self.stale = False  # described, and the parent's view had changed: passed on as bytes

    def deliver(self, kind: Kind, value: Any) -> None:
        if self.sink is None:
            self.events.put_nowait((kind, value))
        else:
            self.sink(kind, value)


class PartCall:
    """A call opened at the parent whose frames go to a sink as they come, with no task to
    read them (a stream's part, stream_here.py): what its holder gives back and ends."""

    def __init__(self, link: ParentLink, opened: Open, requests: AsyncIterator[bytes], sink: Sink):
        self._link = link
        self._sink = sink
        self.call_id, self._call = link._start(self._received)
        self.ended = False
        link.send(Kind.OPEN, self.call_id, encode_open(opened))
        self._pump = asyncio.create_task(link._pump(self.call_id, self._call, requests))

    def _received(self, kind: Kind, value: Any) -> None:
        if kind is Kind.STATUS:
            self.ended = True
            self._link._calls.pop(self.call_id, None)
            self._pump.cancel()
        self._sink(kind, value)

    def took(self) -> None:
        """The holder took one of the parent's messages: its credit goes back."""
        self._call.unread -= 1
        if count := self._call.credit.took():
            self._link.give_credit(self.call_id, count)

    def close(self) -> None:
        """The holder is done before the parent's end: the parent is told to stop."""
        self._pump.cancel()
        if not self.ended:
            self.ended = True
            self._link._calls.pop(self.call_id, None)
            self._link.send(Kind.CANCEL, self.call_id)


class ParentLink(FrameConnection):
    """The front-end's end of its dispatch connection."""

    def __init__(
        self,
        index: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        max_message: int,
        restriction: Restriction | None,
    ) -> None:
        """`restriction`: ModelInfer's (--restricted-protocol inference:...), if any."""
        super().__init__(reader, writer, max_message)
        self.max_message = max_message
        self.index = index
        self.restriction = restriction
        self.h3: list[H3Server] = []  # the gRPC port's, and the REST port's
        self._calls: dict[int, _Forwarded] = {}
        self._next_id = 1
        self.view = ModelView()
        self._entries: Sequence[ViewEntry] = ()  # the view's versions
        # With --frontend-queues: the versions this process queues for itself, and what it
        # serves their calls with.
        self.shared: SharedVersions | None = None
        self.serving: Serving | None = None
        self.streams: StreamHere | None = None  # ModelStreamInfer, with --frontend-queues
        # What the calls this front-end serves itself count: ModelStatistics (per version)
        # and its own metrics (None: --no-metrics), both sent in each report.
        self.counts = LocalCounts()
        self.metrics: Metrics | None = None
        self.served_here: ServedHere | None = None  # counted in `metrics`
        self.h2_rpcs: RpcCount | None = None  # --max-concurrent-rpcs over HTTP/2, for the host
        self.reports = ReportSender(
            self,
            ReportFrames(
                index,
                self.max_payload,
                lambda call_id, payload: self.send(Kind.STATS, call_id, payload),
            ),
        )
        # The method paths the parent registered (METHODS): a call this process's transport
        # answers itself is labelled by its method only if it is one of them.
        self.methods: frozenset[str] = frozenset()
        # The parent's shared-memory regions this process holds copies of, as ModelInfer
        # calls use them (region_copies.py, placed_here.py; None: such calls go to the parent).
        self.shared_memory: GrpcSharedMemory | None = None

    def hello(self) -> None:
        """Tell the parent this front-end's listeners accept calls (its readiness waits for
        every front-end's)."""
        self.send(Kind.HELLO, 0, encode_count(self.index))

    async def forward(
        self, method: str, transport: str, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncGenerator[bytes, None]:
        """The behavior of every method but ModelInfer (and ModelStreamInfer, when this
        process holds streams): the call's messages to the parent and back."""
        opened = opened_of(method, transport, context, auth_of(context.auth_context()))
        async with contextlib.aclosing(self.relay(opened, requests, context)) as answers:
            async for message in answers:
                yield message

    async def infer(self, transport: str, message: bytes, context: Any) -> bytes:
        """ModelInfer: served here, on a version this process queues for itself; else passed
        on as a descriptor when the view describes it, unless the parent says the view is
        stale; else as the message it came as."""
        started = time.perf_counter_ns()
        placed = self.placed(context)
        try:
            described = await self.view.describe(message, placed)
            opened = opened_of(MODEL_INFER, transport, context)
            if isinstance(described, Refusal):
                if self._answer_refusal(opened, described, time.perf_counter_ns() - started):
                    await context.abort(described.status.code, described.status.details)
                described = None
            if described is not None:
                served = None if self.shared is None else self.shared.serving(described.token)
                if served is not None and self.serving is not None:
                    if self.served_here is not None:
                        self.served_here.count(transport)
                    return await serve_here(
                        self.serving, opened, described, served, context, placed
                    )
        finally:
            if placed is not None:
                placed.close()
        # A call naming regions that is not served here goes to the parent whole, which reads
        # and writes the regions itself.
        if described is not None and not (placed is not None and placed.named):
            # Raw BYTES elements take 4 bytes of length where the message may have used 1:
            # a descriptor past the frame limit goes as the message it came as.
            payload = encode_infer(opened, described)
            if len(payload) <= self.max_payload:
                call_id, call = self._start()
                self.send(Kind.INFER, call_id, payload)
                answers = self._answers(call_id, call, context, answer_message, credit=False)
                answered = [answer async for answer in answers]
                if not call.stale:
                    return await _one(answered, context)
        requests = _replay([message], _none())
        return await _one([m async for m in self.relay(opened, requests, context)], context)

    def placed(self, context: Any) -> PlacedTensors | None:
        """Where a call's tensors in shared-memory regions go, if this process holds copies
        of the regions (else such calls go to the parent)."""
        if self.shared_memory is None:
            return None
        return PlacedTensors(self.shared_memory, context, self.max_message)

    async def relay(
        self, opened: Open, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncGenerator[bytes, None]:
        """A call opened at the parent: `requests` to it, its answers back; its metadata
        and status go to `context` (a status other than OK is `context.abort`)."""
        call_id, call = self._start()
        self.send(Kind.OPEN, call_id, encode_open(opened))
        pump = asyncio.create_task(self._pump(call_id, call, requests))
        # Closed here, not left to the collector: its end is what tells the parent that a
        # client who left while its answer waited for the transport is gone.
        answers = self._answers(call_id, call, context, bytes, credit=True)
        try:
            async with contextlib.aclosing(answers) as messages:
                async for message in messages:
                    yield message
        finally:
            pump.cancel()

    def _answer_refusal(self, opened: Open, refusal: Refusal, elapsed_ns: int) -> bool:
        """Report a refusal to the parent, which records it, if this front-end may answer it:
        not when the caller lacks ModelInfer's restricted-protocol header (the parent's answer
        to that comes first) or the report is over the frame limit."""
        if self.restriction is not None and not self.restriction.allows(opened.metadata):
            return False
        payload = encode_refusal(opened, refusal, elapsed_ns)
        if len(payload) > self.max_payload:
            return False
        self.send(Kind.REFUSED, 0, payload)
        return True

    def _start(self, sink: Sink | None = None) -> tuple[int, _Forwarded]:
        call_id, self._next_id = self._next_id, (self._next_id + 1) & 0xFFFFFFFF or 1
        call = self._calls[call_id] = _Forwarded(sink)
        return call_id, call

    def open_part(self, opened: Open, requests: AsyncIterator[bytes], sink: Sink) -> PartCall:
        return PartCall(self, opened, requests, sink)

    async def _answers(
        self,
        call_id: int,
        call: _Forwarded,
        context: Any,
        message: Callable[[bytes], bytes],
        credit: bool,
    ) -> AsyncGenerator[bytes, None]:
        """What the parent sends for the call, to the client, up to its end (STALE: none).
        `credit`: give it back per message (a described call's one answer needs none)."""
        status = _GONE
        try:
            while True:
                kind, value = await call.events.get()
                if kind is Kind.MESSAGE:
                    call.unread -= 1
                    yield message(value)
                    if credit and (count := call.credit.took()):
                        self.give_credit(call_id, count)
                elif kind is Kind.HEADERS:
                    await context.send_initial_metadata(value)
                elif kind is Kind.STATUS:
                    status = value
                    break
                elif kind is Kind.STALE:
                    call.stale = True
                    return
                else:  # CANCEL: the client's request stream failed; the transport ends the call
                    raise value
        finally:
            self._calls.pop(call_id, None)
            if status is _GONE and not call.stale:
                self.send(Kind.CANCEL, call_id)
        if status.code is grpc.StatusCode.OK:
            if status.trailing:
                context.set_trailing_metadata(status.trailing)
            return
        await context.abort(status.code, status.details, status.trailing)

    async def _pump(self, call_id: int, call: _Forwarded, requests: AsyncIterator[bytes]) -> None:
        try:
            async for message in requests:
                await call.window.take()
                self.send(Kind.MESSAGE, call_id, message)
                await self.drain()
            self.send(Kind.HALF_CLOSE, call_id)
        except Exception as exc:
            call.deliver(Kind.CANCEL, exc)

    def received(self, received: Frame) -> None:
        kind, call_id, payload = received
        if kind is Kind.STATS_QUERY:
            self.reports.report(answering=call_id)
            return
        if kind is Kind.MODELS:
            view = decode_view(payload)
            self.view.update(view.entries, view.generation)
            self._entries = view.entries
            return
        if kind is Kind.QUEUED and self.shared is not None:
            self.shared.update(payload, self._entries)
            return
        if kind is Kind.METHODS:
            self.methods = decode_methods(payload)
            return
        if kind is Kind.WORKER and self.shared is not None:
            self.shared.told(payload)
            return
        call = self._calls.get(call_id)
        if call is None:
            return  # the call ended here first (the client left)
        if kind is Kind.MESSAGE:
            if not call.credit.allows(call.unread):
                raise ProtocolViolation(f"call {call_id}: messages past the credit window")
            call.unread += 1
            call.deliver(kind, payload)
        elif kind is Kind.HEADERS:
            call.deliver(kind, decode_metadata(payload))
        elif kind is Kind.STATUS:
            call.deliver(kind, decode_status(payload))
        elif kind is Kind.CREDIT:
            call.window.give(decode_count(payload))
        elif kind is Kind.STALE:
            call.deliver(kind, None)
        else:
            raise ProtocolViolation(f"{kind.name} frame from the parent")

    def lost(self) -> None:
        for call in list(self._calls.values()):
            call.deliver(Kind.STATUS, _GONE)


async def _replay(read: list[bytes], requests: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The call's messages again: those already read, then the rest."""
    for message in read:
        yield message
    async for message in requests:
        yield message


async def _one(answers: list[bytes], context: Any) -> bytes:
    """A unary call's answer: status OK comes with one message."""
    if len(answers) != 1:
        await context.abort(grpc.StatusCode.INTERNAL, f"{len(answers)} answers to a unary call")
    return answers[0]


async def _none() -> AsyncIterator[bytes]:
    return
    yield b""
