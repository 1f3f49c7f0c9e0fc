"""A front-end process (`python -m service.frontends.frontend`): terminates HTTP/2 and
HTTP/3 (TLS, QUIC, 0-RTT) on the shared port and passes every call to the parent over the
dispatch connection: ModelInfer calls on the versions the parent described as descriptors it
decoded and validated (model_view.py), every other call as its message bytes, unparsed. It
never imports Paddle."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from service.api.restricted import Restriction, parse_restrictions, restriction_of
from service.backend.sandbox.privileges import undumpable
from service.frontends.described_call import DescribedCall, Serving
from service.frontends.descriptors import (
    MODEL_INFER,
    DescribedAnswer,
    DescribedRequest,
    Refusal,
    decode_view,
    encode_infer,
    encode_refusal,
)
from service.frontends.link import FrameConnection, Window
from service.frontends.listeners import (
    check_client_auth,
    serves_rest_h3,
    start_grpc,
    start_h3,
    start_rest,
)
from service.frontends.local_counts import LocalCounts
from service.frontends.model_view import ModelView, answer_message, response_message
from service.frontends.protocol import (
    WINDOW,
    Frame,
    Kind,
    Open,
    ProtocolViolation,
    Status,
    decode_count,
    decode_metadata,
    decode_status,
    encode_count,
    encode_open,
)
from service.frontends.queue_sharing import QUEUES_SOCKET
from service.frontends.reports import report_payloads
from service.frontends.rest_forward import RestForwarder
from service.frontends.runtime import DISPATCH_SOCKET, observer_of, read_settings
from service.frontends.shared_versions import SharedVersions
from service.frontends.stats import report_of
from service.inference.identity import identity_of
from service.observability.logs import configure_logging
from service.observability.metrics import Metrics
from service.observability.summed import families_json
from service.registry.versions import ModelRegistry
from service.serving.requests import RequestRunner
from service.settings import ServerSettings
from service.tickets.store import open_ticket_store
from transport.h3.datagram_routing import DatagramRouter
from transport.h3.server import H3Server

log = logging.getLogger("paddlequic.frontend")

REPORT_EVERY_S = 1.0
# The call's end when the parent never sent one: the parent is gone, or the client left first.
_GONE = Status(grpc.StatusCode.UNAVAILABLE, "this front-end lost its server process", ())


class _Forwarded:
    """One call passed on: what the parent sent back for it, in order."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[tuple[Kind, Any]] = asyncio.Queue()
        self.window = Window()
        self.stale = False  # described, and the parent's view had changed: passed on as bytes
        self.local: DescribedCall | None = None  # served here (shared_versions.py)


class _ServedHere(DescribedCall):
    """A described call this process serves itself: its answer is the response message."""

    def encode(self, answer: DescribedAnswer) -> bytes:
        return response_message(answer)


class _Here:
    """The link a call served in this process answers on: its frames go to the call as the
    parent's would."""

    def __init__(self, link: ParentLink) -> None:
        self._link = link

    def send(self, kind: Kind, call_id: int, payload: bytes = b"") -> None:
        self._link.deliver(kind, call_id, payload)

    def flush_large(self) -> None:
        pass

    def ended(self, call_id: int) -> None:
        pass


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
        self.index = index
        self.restriction = restriction
        self.h3: list[H3Server] = []  # the gRPC port's, and the REST port's
        self._calls: dict[int, _Forwarded] = {}
        self._next_id = 1
        self.view = ModelView()
        self._configs: dict[int, bytes] = {}  # the view's versions' configs, by token
        # With --frontend-queues: the versions this process queues for itself, and what it
        # serves their calls with.
        self.shared: SharedVersions | None = None
        self.serving: Serving | None = None
        self._here = _Here(self)
        # What the calls this front-end serves itself count: ModelStatistics (per version)
        # and its own metrics (None: --no-metrics), both sent in each report.
        self.counts = LocalCounts()
        self.metrics: Metrics | None = None
        self._left_out: set[str] = set()  # parts of reports too large to send, logged once

    def hello(self) -> None:
        """Tell the parent this front-end's listeners accept calls (its readiness waits for
        every front-end's)."""
        self.send(Kind.HELLO, 0, encode_count(self.index))

    def handlers(self, transport: str) -> grpc.GenericRpcHandler[Any, Any]:
        return _Forwarder(self, transport)

    async def forward(
        self, method: str, transport: str, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        """The behavior of every method: the call's messages to the parent and back; a
        ModelInfer call the view describes goes as a descriptor, unless the parent says the
        view is stale."""
        if method == MODEL_INFER:
            started = time.perf_counter_ns()
            head = [message async for message in _first(requests, 2)]
            requests = _replay(head, requests)
            described = await self.view.describe(head[0]) if len(head) == 1 else None
            opened = _opened(method, transport, context)
            if isinstance(described, Refusal):
                if self._answer_refusal(opened, described, time.perf_counter_ns() - started):
                    await context.abort(described.status.code, described.status.details)
                    return
                described = None
            here = self._serve_here(opened, described, context)
            if here is not None:
                async for message in here:
                    yield message
                return
            payload = b"" if described is None else encode_infer(opened, described)
            # Raw BYTES elements take 4 bytes of length where the message may have used 1:
            # a descriptor past the frame limit goes as the message it came as.
            if described is not None and len(payload) <= self.max_payload:
                call_id, call = self._start()
                self.send(Kind.INFER, call_id, payload)
                answers = self._answers(call_id, call, context, answer_message, credit=False)
                async for message in answers:
                    yield message
                if not call.stale:
                    return
        async for message in self.relay(_opened(method, transport, context), requests, context):
            yield message

    async def relay(
        self, opened: Open, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        """A call opened at the parent: `requests` to it, its answers back; its metadata
        and status go to `context` (a status other than OK is `context.abort`)."""
        call_id, call = self._start()
        self.send(Kind.OPEN, call_id, encode_open(opened))
        pump = asyncio.create_task(self._pump(call_id, call, requests))
        try:
            async for message in self._answers(call_id, call, context, bytes, credit=True):
                yield message
        finally:
            pump.cancel()

    def _serve_here(
        self, opened: Open, described: DescribedRequest | None, context: Any
    ) -> AsyncIterator[bytes] | None:
        """A call on a version this process queues for itself, served here as the parent
        serves a described call (described_call.py): into a worker's queue, and back."""
        served = (
            None
            if described is None or self.shared is None
            else self.shared.serving(described.token)
        )
        if served is None or described is None or self.serving is None:
            return None
        call_id, call = self._start()
        call.local = _ServedHere(self._here, call_id, opened, served, described, self.serving)
        call.local.start()
        return self._answers(call_id, call, context, bytes, credit=False)

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

    def _start(self) -> tuple[int, _Forwarded]:
        call_id, self._next_id = self._next_id, (self._next_id + 1) & 0xFFFFFFFF or 1
        call = self._calls[call_id] = _Forwarded()
        return call_id, call

    async def _answers(
        self,
        call_id: int,
        call: _Forwarded,
        context: Any,
        message: Callable[[bytes], bytes],
        credit: bool,
    ) -> AsyncIterator[bytes]:
        """What the parent sends for the call, to the client, up to its end (STALE: none).
        `credit`: give it back per message (a described call's one answer needs none)."""
        status = _GONE
        try:
            while True:
                kind, value = await call.events.get()
                if kind is Kind.MESSAGE:
                    yield message(value)
                    if credit:
                        self.give_credit(call_id)
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
            if status is _GONE and call.local is not None:
                call.local.cancel()
            elif status is _GONE and not call.stale:
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
            call.events.put_nowait((Kind.CANCEL, exc))

    def received(self, received: Frame) -> None:
        kind, call_id, payload = received
        if kind is Kind.STATS_QUERY:
            self.report(answering=call_id)
            return
        if kind is Kind.MODELS:
            entries = decode_view(payload)
            self.view.update(entries)
            self._configs = {entry.token: entry.config for entry in entries}
            return
        if kind is Kind.QUEUED and self.shared is not None:
            self.shared.update(payload, self._configs)
            return
        if kind is Kind.WORKER and self.shared is not None:
            self.shared.told(payload)
            return
        self.deliver(kind, call_id, payload)

    def deliver(self, kind: Kind, call_id: int, payload: bytes) -> None:
        """A frame for one call: from the parent, or from the call served here."""
        call = self._calls.get(call_id)
        if call is None:
            return  # the call ended here first (the client left)
        if kind is Kind.MESSAGE:
            if call.events.qsize() > WINDOW + 2:  # the window, headers, a status
                raise ProtocolViolation(f"call {call_id}: messages past the credit window")
            call.events.put_nowait((kind, payload))
        elif kind is Kind.HEADERS:
            call.events.put_nowait((kind, decode_metadata(payload)))
        elif kind is Kind.STATUS:
            call.events.put_nowait((kind, decode_status(payload)))
        elif kind is Kind.CREDIT:
            call.window.give(decode_count(payload))
        elif kind is Kind.STALE:
            call.events.put_nowait((kind, None))
        else:
            raise ProtocolViolation(f"{kind.name} frame from the parent")

    def report(self, answering: int = 0) -> None:
        """This process's counts, to the parent (reports.py): its HTTP/3 servers', the
        requests it holds of the versions it queues for itself, the ModelStatistics counts and
        metrics of the calls it serves itself. `answering`: the STATS_QUERY this answers (0:
        none; its last frame carries it)."""
        totals: dict[str, Any] = {}
        if self.h3:
            totals["h3"] = report_of(self.h3).to_json()
        if self.shared is not None:
            totals["held"] = self.shared.held()
        models = self.counts.take()
        if not (answering or totals or models or self.metrics):
            return
        report = report_payloads(
            totals,
            models,
            families_json(self.metrics.registry.collect()) if self.metrics else None,
            self.max_payload,
        )
        for part, size in report.left_out.items():
            if part not in self._left_out:
                self._left_out.add(part)
                log.error(
                    "front-end %d: its report's %s (%d bytes) are past the dispatch frame "
                    "limit (%d bytes): left out of the server's counts",
                    self.index,
                    part,
                    size,
                    self.max_payload,
                )
        last = len(report.payloads) - 1
        for position, payload in enumerate(report.payloads):
            self.send(Kind.STATS, answering if position == last else 0, payload)

    def lost(self) -> None:
        for call in self._calls.values():
            call.events.put_nowait((Kind.STATUS, _GONE))


def _opened(method: str, transport: str, context: Any) -> Open:
    return Open(
        method,
        transport,
        context.peer(),
        context.time_remaining(),
        tuple(context.invocation_metadata() or ()),
        identity_of(context),
    )


async def _first(requests: AsyncIterator[bytes], count: int) -> AsyncIterator[bytes]:
    """Up to `count` messages of the call (a unary call's one, and whether more follow)."""
    for _ in range(count):
        message = await anext(requests, None)
        if message is None:
            return
        yield message


async def _replay(read: list[bytes], requests: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The call's messages again: those already read, then the rest."""
    for message in read:
        yield message
    async for message in requests:
        yield message


class _Forwarder(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """Every method, whatever its kind, as a bidirectional stream of raw bytes: the wire
    format is the same, and the parent enforces what a unary method may receive. ModelInfer,
    the one most calls make, as the unary method it is: the transport reads its one message
    (and refuses a second, as the parent would), which costs less than a stream."""

    def __init__(self, link: ParentLink, transport: str) -> None:
        self._link = link
        self._transport = transport

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any]:
        method = handler_call_details.method
        link, transport = self._link, self._transport

        async def forward(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            async for message in link.forward(method, transport, requests, context):
                yield message

        async def unary(request: bytes, context: Any) -> bytes:
            requests = _replay([request], _none())
            answers = [m async for m in link.forward(method, transport, requests, context)]
            if len(answers) != 1:  # a unary call's status OK comes with one message
                await context.abort(grpc.StatusCode.INTERNAL, f"{len(answers)} answers")
            return answers[0]

        if method == MODEL_INFER:
            return grpc.unary_unary_rpc_method_handler(unary)
        return grpc.stream_stream_rpc_method_handler(forward)


async def _none() -> AsyncIterator[bytes]:
    return
    yield b""


class ParentUnreachable(Exception):
    """The dispatch socket refused the front-end: nothing to serve for."""


async def run(index: int, runtime_dir: Path, settings: ServerSettings) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # The parent stops every front-end and reloads models once: the terminal's signals to
    # the whole process group are its business.
    for ignored in (signal.SIGINT, signal.SIGHUP):
        signal.signal(ignored, signal.SIG_IGN)
    try:
        reader, writer = await asyncio.open_unix_connection(runtime_dir / DISPATCH_SOCKET)
    except OSError as exc:
        # The parent is gone or not listening: its supervisor (if any) starts a new front-end.
        raise ParentUnreachable(
            f"front-end {index}: cannot reach the parent at {runtime_dir / DISPATCH_SOCKET} "
            f"({exc.strerror or exc}); front-ends are started by `paddlequic serve "
            "--frontends N`, not on their own"
        ) from None
    restriction = restriction_of(parse_restrictions(settings.restricted_protocol), MODEL_INFER)
    link = ParentLink(index, reader, writer, settings.max_message_bytes, restriction)
    if settings.metrics:
        link.metrics = Metrics.frontend(link.view.served)
    tracing = None
    if settings.instance_queues and settings.frontend_queues:
        observer, tracing = observer_of(settings, link.metrics)
        link.serving = Serving(
            RequestRunner(ModelRegistry(_nothing), observer),
            observer,
            restriction,
            settings.max_message_bytes,
        )
        link.shared = SharedVersions(
            index,
            lambda kind, payload: link.send(kind, 0, payload),
            runtime_dir / QUEUES_SOCKET,
            observer,
            link.counts.stats,
        )
    reading = asyncio.create_task(link.run())
    client_auth = check_client_auth(settings)
    tls = (Path(settings.tls_cert), Path(settings.tls_key)) if settings.tls_cert else None
    grpc_server, port = await start_grpc(
        settings,
        lambda s: s.add_generic_rpc_handlers([link.handlers("h2")]),
        client_auth,
        tls,
        reuse_port=True,
    )
    rest = RestForwarder(link) if settings.http_port else None
    if tls is not None and settings.h3:
        tickets = open_ticket_store(
            settings.ticket_store, settings.ticket_key_file, settings.ticket_ttl
        )
        # The gRPC port's, then the REST port's number when it is another (each with its own
        # datagram router): both serve gRPC and REST, each stream routed by its request.
        ports = [None, settings.http_port] if rest and serves_rest_h3(settings, port) else [None]
        for udp_port in ports:
            link.h3.append(
                await start_h3(
                    settings,
                    port,
                    lambda s: s.add_generic_rpc_handlers([link.handlers("h3")]),
                    tls,
                    client_auth,
                    tickets,
                    reuse_port=True,
                    router=DatagramRouter(index, runtime_dir, "rest" if udp_port else ""),
                    plain=rest,
                    udp_port=udp_port,
                )
            )
    http = (
        await start_rest(settings, rest, tls, client_auth, reuse_port=True)
        if rest is not None
        else None
    )
    link.hello()
    gc.freeze()  # as the single server does once ready: full collections skip start-up's objects
    reporter = asyncio.create_task(_report(link))
    closed = asyncio.create_task(link.closed.wait())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({closed, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if link.closed.is_set() and not stop.is_set():
        log.error("front-end %d: the parent is gone; stopping", index)
    await asyncio.gather(
        grpc_server.stop(settings.grace_period),
        *(h3.stop(settings.grace_period) for h3 in link.h3),
        *([http.stop(settings.grace_period)] if http else []),
    )
    if link.shared is not None:
        await link.shared.stop()
    if tracing is not None:
        tracing.shutdown()
    link.report()
    link.flush()  # the last report goes out before the process ends
    for task in (reporter, closed, stopping, reading):
        task.cancel()


async def _report(link: ParentLink) -> None:
    while True:
        link.report()
        await asyncio.sleep(REPORT_EVERY_S)


def _nothing() -> None:
    pass


def main(argv: Sequence[str] | None = None) -> int:
    undumpable()  # as the server's main process: its environment holds the same secrets
    parser = argparse.ArgumentParser(prog="python -m service.frontends.frontend")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--runtime-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    settings = read_settings(args.runtime_dir)
    configure_logging(settings.log_format, settings.log_level)
    logging.getLogger("quic").setLevel(logging.WARNING)
    log.debug("front-end %d (pid %d) starting", args.index, os.getpid())
    try:
        asyncio.run(run(args.index, args.runtime_dir, settings))
    except ParentUnreachable as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
