"""ModelStreamInfer in a front-end that queues for itself (--frontend-queues). A request on a
version this process queues for itself runs here, as its ModelInfer call would (served_here.py),
and so does a decoupled model's, its responses read from this process's own socket to the
worker (remote_streams.py): the parent takes no part in either. Every other request (a
sequence or Python model's, one the view does not describe or its validator refuses) goes to
the parent in the stream's *part*: one stream of the parent's, opened at the first such
request, that runs them as any stream's (ordering a sequence's requests, the errors in the
parent's words) and whose responses join the caller's as they come (stream_parts.py).

The stream is one call, observed here (the part is not observed again). Its window, buffer and
stall bound are those of a stream the parent holds (stream_inference.py): a request, wherever
it runs, holds its place in the window until its last response was taken (the part says which
is a request's last)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from protos.inference import grpc_service_pb2 as pb
from service.api import stream_parts, stream_responses
from service.api.callers import client_of
from service.api.restricted import guarded
from service.api.stream_inference import STREAM_WINDOW, generated, stalled
from service.api.stream_outbox import Outbox, StallWatch, StreamBounds
from service.api.wire_limits import request_problem
from service.frontends.described_call import DescribedCall, Serving
from service.frontends.descriptors import DescribedAnswer, DescribedRequest, Refusal
from service.frontends.model_view import response_of
from service.frontends.placed_here import PlacedTensors
from service.frontends.protocol import PART, Kind, Open, Status, decode_status
from service.inference import errors
from service.observability.handlers import ObservedCall, observed_responses
from service.observability.observer import carried
from service.registry.versions import ServedVersion

MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


class PartCall(Protocol):
    """The parent's end of a stream's part, as the stream uses it (parent_link.py)."""

    def took(self) -> None: ...

    def close(self) -> None: ...


Sink = Callable[[Kind, Any], None]


@dataclasses.dataclass(frozen=True)
class StreamHere:
    """What a front-end serves its streams with."""

    serving: Serving
    bounds: StreamBounds
    # The view's descriptor of a request (model_view.py), and the version this process
    # serves for a descriptor's token (None: the parent's).
    describe: Callable[[bytes, PlacedTensors | None], Awaitable[DescribedRequest | Refusal | None]]
    served: Callable[[int], ServedVersion | None]
    # A stream opened at the parent: its requests sent as they come, what it sends back given
    # to the sink as it comes.
    open_part: Callable[[Open, AsyncIterator[bytes], Sink], PartCall]
    # Where each request ran (True: here), counted (served_here.py); None: --no-metrics.
    count: Callable[[bool], None] | None = None
    # Where a request's tensors in shared-memory regions go, given the stream's context
    # (placed_here.py; None: such requests go to the parent, in the stream's part).
    placed: Callable[[Any], PlacedTensors | None] = lambda context: None

    async def responses(
        self, opened: Open, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncGenerator[bytes, None]:
        """The caller's stream (`opened`: its call), observed and access-checked here as the
        parent's servicers are."""
        call = ObservedCall(self.serving.observer, opened.transport, opened.method, context)
        stream = _Stream(self, opened, call, context)
        restriction = self.serving.restriction
        run: Callable[[AsyncIterator[bytes], Any], AsyncGenerator[bytes, None]] = (
            stream.run if restriction is None else guarded(stream.run, restriction)
        )
        responses = observed_responses(call, run(requests, context))
        async with contextlib.aclosing(responses) as answers:
            async for response in answers:
                yield response


# What taking an outbox item does: free its request's place in the window (a request's last
# response), give the parent its credit back (the part's responses).
_FREES, _CREDITS = 1, 2
_Item = tuple[bytes, int]


class _Stream:
    """One caller's stream. Its requests' answers come by callbacks (a request run here: its
    DescribedCall's; the part: its frames, as the link reads them), so nothing but the reader
    and the transport's sends needs a task; an answer with no room in the outbox waits in one.
    """

    def __init__(self, here: StreamHere, opened: Open, call: ObservedCall, context: Any) -> None:
        self.here = here
        self.opened = opened
        self.call = call
        self.context = context
        self.outbox: Outbox[_Item | None] = Outbox(
            STREAM_WINDOW + 1, here.bounds.buffer_bytes, _size
        )
        self.window = asyncio.Semaphore(STREAM_WINDOW)
        self.running: set[_RunHere] = set()  # requests run here, not answered yet
        # Answers waiting for room, and a decoupled model's requests run here.
        self.waiting: set[asyncio.Task[None]] = set()
        self.part: PartCall | None = None
        self.part_requests: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=1)
        self.part_in_flight = 0  # passed on, their last response not come yet
        self.part_done = False
        self.failed: Status | None = None  # how the part ended, when not OK
        self.cancelled = 0  # how many requests the stall cancelled
        self.reading = True
        self.reader: asyncio.Task[None] | None = None
        self._end_put = False

    async def run(
        self, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncGenerator[bytes, None]:
        reader = self.reader = asyncio.create_task(self._read(requests))
        watch = StallWatch(self.here.bounds.stall_s, self._stall)
        try:
            while (item := await self.outbox.get()) is not None:
                data, taking = item
                watch.sending()
                yield data
                watch.sent()
                if watch.stalled:
                    break
                if taking & _FREES:
                    self.window.release()
                if taking & _CREDITS and self.part is not None:
                    self.part.took()
            if watch.stalled:
                await errors.abort(context, stalled(self.here.bounds.stall_s, self.cancelled))
            if self.failed is not None:
                failed = self.failed
                await context.abort(failed.code, failed.details, failed.trailing)
            await reader  # its failure (the caller's request stream's) is the stream's
        finally:
            watch.close()
            self._end()

    def _end(self) -> None:
        """Every request still in flight cancelled (the stream ended, or stalled)."""
        self._cancel_here()
        if self.part is not None:
            self.part.close()  # the parent stops it, unless it ended already

    def _cancel_here(self) -> None:
        """The reader and the requests run here cancelled."""
        if self.reader is not None:
            self.reader.cancel()
        for running in list(self.running):
            running.call.cancel()
        self.running.clear()
        for task in list(self.waiting):
            task.cancel()

    def _stall(self) -> None:
        """The caller took nothing for stall_s: its requests end now, not when it leaves."""
        self.cancelled = len(self.running) + len(self.waiting) + self.part_in_flight
        self.here.bounds.on_stall()
        self._end()
        self.outbox.clear()

    def _put_end(self) -> None:
        if not self._end_put:
            self._end_put = True
            self.outbox.put(None)

    def _check_done(self) -> None:
        """The stream's end goes after its last answer: every request read and answered."""
        if self.reading or self.running or self.waiting:
            return
        if self.part is None or self.part_done:
            self._put_end()

    async def _read(self, requests: AsyncIterator[bytes]) -> None:
        first = True
        try:
            async for message in requests:
                # Where its tensors in regions go: held from its description until it ends,
                # if it runs here (a request passed on, or a decoupled one, reads none here).
                placed = self.here.placed(self.context)
                served: ServedVersion | None = None
                try:
                    described = await self.here.describe(message, placed)
                    if first:  # the stream's labels, as the parent takes them from its first
                        self.call.saw(described if described is not None else _named(message))
                        first = False
                    await self.window.acquire()  # each request, wherever it runs
                    if isinstance(described, DescribedRequest):
                        served = self.here.served(described.token)
                finally:
                    if placed is not None and (served is None or served.decoupled):
                        placed.close()
                if self.here.count is not None:
                    self.here.count(served is not None)
                if served is None:
                    await self._pass_on(message)
                    continue
                assert isinstance(described, DescribedRequest)
                if served.decoupled:
                    self._wait_in(self._generate(described, served))
                else:
                    self._run_here(described, served, placed)
            if self.part is not None:
                await self.part_requests.put(None)  # the part half-closes
        except BaseException:
            self._put_end()  # the stream ends now: run() ends the rest
            raise
        self.reading = False
        self._check_done()

    def _run_here(
        self, described: DescribedRequest, served: ServedVersion, placed: PlacedTensors | None
    ) -> None:
        """One request run here; its answer comes to `answered`. `placed`: where its tensors
        in shared-memory regions go (released once it ended)."""
        running = _RunHere(self, described, placed)
        opened = dataclasses.replace(self.opened, timeout=self.context.time_remaining())
        running.call = _InStream(
            running, 0, opened, served, described, self.here.serving, self.call
        )
        running.call.placed = placed
        self.running.add(running)
        running.call.start()

    def answered(self, running: _RunHere, data: bytes) -> None:
        """A request run here answered: its response for the caller, now or once there is
        room."""
        if running not in self.running:
            return  # cancelled
        self.running.discard(running)
        item = (data, _FREES)
        if not self.outbox.put_now(item):
            self._wait_in(self._put_later(item))
        self._check_done()

    def _wait_in(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.waiting.add(task)
        task.add_done_callback(self._waited)

    async def _put_later(self, item: _Item) -> None:
        await self.outbox.room()
        self.outbox.put(item)

    async def _generate(self, described: DescribedRequest, served: ServedVersion) -> None:
        """A decoupled model's request run here, as the parent's stream runs it
        (stream_inference.py): each response built once the outbox has room for it, the
        last one freeing the request's place; an error its final response."""
        request, job = described.message, described.job
        assert request is not None and job is not None
        remaining = self.context.time_remaining()
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        try:
            answers = self.here.serving.runner.stream(
                served,
                job,
                request.id,
                stream_responses.parameters(request),
                deadline,
                client_of(self.context),
            )
            counts = dict(described.classes)
            items = generated(answers, served, request, self.outbox.room, counts)
            async with contextlib.aclosing(items) as each:
                async for response, final in each:
                    if response is None:  # a final with nothing to send
                        self.window.release()
                    else:
                        flags = _FREES if final else 0
                        self.outbox.put((response.SerializeToString(), flags))
        except errors.ServiceError as exc:
            response = stream_responses.failed(request, exc, decoupled=True)
            await self.outbox.room()
            self.outbox.put((response.SerializeToString(), _FREES))

    def _waited(self, task: asyncio.Task[None]) -> None:
        self.waiting.discard(task)
        self._check_done()

    async def _pass_on(self, message: bytes) -> None:
        if self.part is None:
            opened = dataclasses.replace(
                self.opened,
                transport=self.opened.transport + PART,
                timeout=self.context.time_remaining(),
                metadata=carried(self.call, self.opened.metadata),
            )
            self.part = self.here.open_part(opened, self._part_messages(), self._from_part)
        self.part_in_flight += 1
        await self.part_requests.put(message)

    async def _part_messages(self) -> AsyncIterator[bytes]:
        while (message := await self.part_requests.get()) is not None:
            yield message

    def _from_part(self, kind: Kind, value: Any) -> None:
        """What the parent sends for the part, as the link reads it: a response goes in the
        outbox at once (the part's credit window bounds how many wait there), and its credit
        goes back once the caller took it, as does its request's place in the stream's window
        if it is its last; a part that ends in error ends the stream with its status."""
        if kind is Kind.MESSAGE:
            data, last = stream_parts.decode(value)
            if data is None:
                assert self.part is not None
                self.part.took()
                if last:
                    self.window.release()
            else:
                self.outbox.put((data, _CREDITS | (_FREES if last else 0)))
            if last:
                self.part_in_flight -= 1
        elif kind is Kind.STATUS:
            self.part_done = True
            if value.code is not grpc.StatusCode.OK:
                self.fail(value)
            self._check_done()
        elif kind is Kind.CANCEL:  # sending the part's requests failed: the link is going
            self.part_done = True
            self.fail(Status(grpc.StatusCode.UNAVAILABLE, f"the stream's part failed: {value}", ()))

    def fail(self, status: Status) -> None:
        """The part ended in error: the stream ends with its status once what the outbox
        holds is sent."""
        if self.failed is None:
            self.failed = status
        self._cancel_here()
        self._put_end()


class _RunHere:
    """A request of the stream run here: the link its DescribedCall answers on."""

    def __init__(
        self, stream: _Stream, described: DescribedRequest, placed: PlacedTensors | None
    ) -> None:
        self.stream = stream
        self.described = described
        self.placed = placed
        self.call: DescribedCall
        self._data = b""

    def send(self, kind: Kind, call_id: int, payload: bytes = b"") -> None:
        if kind is Kind.MESSAGE:
            self._data = payload
        elif kind is Kind.STATUS:
            status = decode_status(payload)
            data = self._data
            if status.code is not grpc.StatusCode.OK:
                text = f"{status.code.name}: {status.details}"
                data = stream_responses.error(self.described, text).SerializeToString()
            self.stream.answered(self, data)

    def flush_large(self) -> None:
        pass

    def ended(self, call_id: int) -> None:
        """Its call ended, answered or cancelled: its regions are let go."""
        if self.placed is not None:
            self.placed.close()


class _InStream(DescribedCall):
    """A request of a stream, run here: its answer is the stream's response message."""

    def encode(self, answer: DescribedAnswer) -> bytes:
        return pb.ModelStreamInferResponse(infer_response=response_of(answer)).SerializeToString()


def _named(message: bytes) -> pb.ModelInferRequest | None:
    """A request passed on as it came, parsed for the stream's labels (its model, version
    and id), if it is within the wire limits and parses."""
    if request_problem(message)[0]:
        return None
    try:
        return pb.ModelInferRequest.FromString(message)
    except DecodeError:
        return None


def _size(item: _Item | None) -> int:
    return 0 if item is None else len(item[0])
