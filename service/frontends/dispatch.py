"""The parent's dispatch endpoint: front-ends pass it each call (method, metadata, deadline,
message bytes as received); it runs the servicers registered on it, per transport, as the
transports do, so observation, access checks and tracing run once, here, labelled with the
transport the front-end got the call on. ModelInfer calls a front-end described (INFER) run
as plain objects (described_call.py), observed and checked by the same functions, with no
protobuf, task or servicer context here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from service.frontends.described_call import DescribedCall
from service.frontends.described_infer import DescribedInfer, StaleView
from service.frontends.descriptors import decode_infer, decode_refusal
from service.frontends.dispatched_call import TRANSPORTS, DispatchedCall, transport_of
from service.frontends.link import FrameConnection, Questions
from service.frontends.protocol import (
    Frame,
    Kind,
    Open,
    ProtocolViolation,
    decode_count,
    decode_open,
    encode_methods,
    encode_status,
)
from service.frontends.queue_sharing import QUEUES_SOCKET, SharedQueues
from service.frontends.reports import Reports
from service.frontends.stats import FrontendMetrics
from transport.grpc.handler_table import HandlerTable
from transport.h3.calls import TransportAnswer

log = logging.getLogger("paddlequic.frontends")

STATS_QUERY_TIMEOUT_S = 1.0


class DispatchServer:
    def __init__(
        self,
        max_message: int,
        reports: Reports,
        metrics: FrontendMetrics | None,
        described: DescribedInfer,
        listening: Callable[[str], None],
        sharing: bool,
    ) -> None:
        """`listening(index)`: a front-end said its listeners accept calls. `sharing`: front-
        ends write the requests of versions they may queue for themselves into the workers'
        queues (queue_sharing.py)."""
        self.max_message = max_message
        self.listening = listening
        self.reports = reports
        self.metrics = metrics
        self.described = described
        self.tables = {transport: HandlerTable() for transport in TRANSPORTS}
        self._links: set[_FrontendLink] = set()
        self._server: asyncio.Server | None = None
        self.sharing = SharedQueues(self._send_all) if sharing else None
        # Where a call that ended before its handler ran is observed (its transport's, the
        # parent's Observer.transport_answered): a unary call whose message never came whole
        # or in time, as the HTTP/3 transport observes those it answers itself.
        self.answered: Callable[[str, TransportAnswer], None] | None = None

    async def start(self, path: Path) -> None:
        self._server = await asyncio.start_unix_server(self._connected, path)
        path.chmod(0o600)
        if self.sharing is not None:
            self.sharing.start(path.parent / QUEUES_SOCKET)

    def _send_all(self, kind: Kind, payload: bytes) -> None:
        for link in list(self._links):
            if link.index != "?":
                link.send(kind, 0, payload)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _FrontendLink(self, reader, writer)
        self._links.add(link)
        try:
            await link.run()
        finally:
            self._links.discard(link)

    def push_view(self) -> None:
        """The served versions changed: every front-end gets the new view."""
        view = self.described.view()  # made even for no link: it holds the versions it names
        queued = self.queued_view()
        for link in list(self._links):
            link.send_view(view, queued)

    def queued_view(self) -> bytes:
        return b"" if self.sharing is None else self.sharing.view(self.described.described)

    async def refresh_stats(self) -> None:
        """Ask every front-end for its report now; wait a moment for the answers. Counts
        recorded by a front-end before it read the question are in its answer (a report
        it sent before, crossing the question, is not taken for the answer)."""
        waits = [link.query_stats() for link in list(self._links)]
        if waits:
            await asyncio.wait(waits, timeout=STATS_QUERY_TIMEOUT_S)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self.sharing is not None:
            self.sharing.stop()
        for link in list(self._links):
            link.abort_calls()


class _FrontendLink(FrameConnection):
    """The parent's end of one front-end's connection."""

    def __init__(
        self, server: DispatchServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        super().__init__(reader, writer, server.max_message)
        self.server = server
        self.index = "?"
        self._calls: dict[int, DispatchedCall | DescribedCall] = {}
        self._stats_wanted = Questions()

    def received(self, received: Frame) -> None:
        kind, call_id, payload = received
        if kind is Kind.OPEN:
            if call_id in self._calls:
                raise ProtocolViolation(f"call {call_id} opened twice")
            self._open(call_id, decode_open(payload))
        elif kind is Kind.INFER:
            if call_id in self._calls:
                raise ProtocolViolation(f"call {call_id} opened twice")
            opened, request = decode_infer(payload)
            try:
                described = self.server.described.call(self, call_id, opened, request)
            except StaleView:
                self.send(Kind.STALE, call_id)
                self.send_view(self.server.described.view(), self.server.queued_view())
                return
            self._count(opened, described=True)
            self._calls[call_id] = described
            described.start()
        elif kind is Kind.REFUSED:
            opened, refusal, elapsed_ns = decode_refusal(payload)
            self._count(opened, described=True)
            self.server.described.refused(opened, refusal, elapsed_ns)
        elif kind is Kind.HELLO:
            self.index = str(decode_count(payload))
            methods = {m for table in self.server.tables.values() for m in table.methods()}
            self.send(Kind.METHODS, 0, encode_methods(methods))
            self.send_view(self.server.described.view(), self.server.queued_view())
            if self.server.sharing is not None:
                self.server.sharing.connected(self.index)
            self.server.listening(self.index)
        elif kind is Kind.TROUBLE and self.server.sharing is not None:
            self.server.sharing.trouble(payload)
        elif kind is Kind.RELEASED and self.server.sharing is not None:
            self.server.sharing.released(self.index, payload)
        elif kind is Kind.STATS:
            # call_id: the last query the front-end answers with this report (0: none)
            report = self.server.reports.report(self, payload)
            # "held" and "breakers" come in the first frame of a report split in several.
            if report is not None and self.server.sharing is not None:
                if "held" in report:
                    self.server.sharing.held(self.index, report["held"])
                if "breakers" in report:
                    self.server.sharing.breakers(self.index, report["breakers"])
            if call_id:
                self._stats_wanted.answered(call_id)
        elif (call := self._calls.get(call_id)) is not None:
            # Frames for a call that already ended cross its STATUS on the way: dropped.
            call.received(kind, payload)

    def send_view(self, view: bytes, queued: bytes) -> None:
        self.send(Kind.MODELS, 0, view)
        if queued:
            self.send(Kind.QUEUED, 0, queued)

    def _count(self, opened: Open, described: bool) -> None:
        if self.server.metrics is not None:
            self.server.metrics.call(self.index, transport_of(opened), described)

    def _open(self, call_id: int, opened: Open) -> None:
        self._count(opened, described=False)
        call = DispatchedCall(self, call_id, opened)
        self._calls[call_id] = call
        call.task = asyncio.get_running_loop().create_task(self._serve(call))

    def ended(self, call_id: int) -> None:
        """A described call ended (answered, or cancelled)."""
        self._calls.pop(call_id, None)

    async def _serve(self, call: DispatchedCall) -> None:
        try:
            status = await call.run()
            if not call.cancelled:
                self.send(Kind.STATUS, call.call_id, encode_status(status))
        finally:
            self._calls.pop(call.call_id, None)

    def query_stats(self) -> asyncio.Future[None]:
        """A report asked for: done once the front-end's answer is in."""
        number, wanted = self._stats_wanted.ask()
        self.send(Kind.STATS_QUERY, number)
        return wanted

    def abort_calls(self) -> None:
        for call in list(self._calls.values()):
            call.cancel()

    def lost(self) -> None:
        self.abort_calls()
        self.server.reports.retire(self)
        if self.server.sharing is not None and self.index != "?":
            self.server.sharing.lost(self.index)
        self._stats_wanted.none_coming()
