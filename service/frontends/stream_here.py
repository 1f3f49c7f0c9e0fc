"""ModelStreamInfer in a front-end that queues for itself (--frontend-queues). A request on a
version this process queues for itself runs here, as its ModelInfer call would (served_here.py),
with no part for the parent. Every other request (a decoupled, sequence or Python model's, one
the view does not describe or its validator refuses) goes to the parent in the stream's *part*:
one stream of the parent's, opened at the first such request, that runs them as any stream's
(ordering a sequence's requests, a decoupled model's many responses, the errors in the
parent's words) and whose responses join the caller's as they come (stream_parts.py).

The stream is one call, observed here (the part is not observed again). Its window, buffer and
stall bound are those of a stream the parent holds (stream_inference.py): a request run here
holds its place in the window until its response was taken; the part's requests are bounded by
the part's own window, and count as in flight until their last response was put."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from protos.inference import grpc_service_pb2 as pb
from service.api import stream_parts, stream_responses
from service.api.restricted import guarded
from service.api.stream_inference import STREAM_WINDOW, stalled
from service.api.stream_outbox import Outbox, StallWatch, StreamBounds
from service.api.wire_limits import request_problem
from service.frontends.described_call import DescribedCall, Serving
from service.frontends.descriptors import DescribedAnswer, DescribedRequest, Refusal
from service.frontends.model_view import response_of
from service.frontends.protocol import PART, Kind, Open, Status
from service.frontends.served_here import AnsweredHere
from service.inference import errors
from service.observability.handlers import ObservedCall, observed_responses
from service.observability.observer import carried
from service.registry.versions import ServedVersion

MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"

# A response's bytes for the caller, and whether taking it frees a place in the window.
_Item = tuple[bytes, bool]
PartEvents = AsyncGenerator[tuple[Kind, Any], None]


@dataclasses.dataclass(frozen=True)
class StreamHere:
    """What a front-end serves its streams with."""

    serving: Serving
    bounds: StreamBounds
    # The view's descriptor of a request (model_view.py), and the version this process
    # serves for a descriptor's token (None: the parent's).
    describe: Callable[[bytes], Awaitable[DescribedRequest | Refusal | None]]
    served: Callable[[int], ServedVersion | None]
    # A stream opened at the parent: its requests sent as they come, what it sends back.
    open_part: Callable[[Open, AsyncIterator[bytes]], PartEvents]

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


class _Part:
    """The requests of a stream passed on to the parent."""

    def __init__(self, open_part: Callable[[AsyncIterator[bytes]], PartEvents]) -> None:
        self.requests: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=1)
        self.events = open_part(self.messages())
        self.in_flight = 0  # passed on, their last response not put yet
        self.task: asyncio.Task[None] | None = None

    async def messages(self) -> AsyncIterator[bytes]:
        while (message := await self.requests.get()) is not None:
            yield message


class _Stream:
    """One caller's stream."""

    def __init__(self, here: StreamHere, opened: Open, call: ObservedCall, context: Any) -> None:
        self.here = here
        self.opened = opened
        self.call = call
        self.context = context
        self.outbox: Outbox[_Item | None] = Outbox(
            STREAM_WINDOW + 1, here.bounds.buffer_bytes, _size
        )
        self.window = asyncio.Semaphore(STREAM_WINDOW)
        self.tasks: set[asyncio.Task[None]] = set()  # the requests run here, in flight
        self.part: _Part | None = None
        self.failed: Status | None = None  # how the part ended, when not OK
        self.cancelled = 0  # how many requests the stall cancelled
        self.reader: asyncio.Task[None] | None = None

    async def run(
        self, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncGenerator[bytes, None]:
        reader = self.reader = asyncio.create_task(self._read(requests))
        watch = StallWatch(self.here.bounds.stall_s, self._stall)
        try:
            while (item := await self.outbox.get()) is not None:
                data, frees = item
                watch.sending()
                yield data
                watch.sent()
                if watch.stalled:
                    break
                if frees:
                    self.window.release()
            if watch.stalled:
                await errors.abort(context, stalled(self.here.bounds.stall_s, self.cancelled))
            if self.failed is not None:
                failed = self.failed
                await context.abort(failed.code, failed.details, failed.trailing)
            await reader
        finally:
            watch.close()
            self._end()

    def _end(self) -> None:
        """Every request still in flight cancelled (the stream ended, or stalled)."""
        if self.reader is not None:
            self.reader.cancel()
        for task in list(self.tasks):
            task.cancel()
        if self.part is not None and self.part.task is not None:
            self.part.task.cancel()  # its events' end sends the parent a CANCEL

    def _stall(self) -> None:
        """The caller took nothing for stall_s: its requests end now, not when it leaves."""
        part = self.part.in_flight if self.part is not None else 0
        self.cancelled = len(self.tasks) + part
        self.here.bounds.on_stall()
        self._end()
        self.outbox.clear()

    async def _read(self, requests: AsyncIterator[bytes]) -> None:
        first = True
        try:
            async for message in requests:
                described = await self.here.describe(message)
                if first:  # the stream's labels, as the parent takes them from its first
                    self.call.saw(described if described is not None else _named(message))
                    first = False
                served = None
                if isinstance(described, DescribedRequest):
                    served = self.here.served(described.token)
                if served is None:
                    await self._pass_on(message)
                    continue
                assert isinstance(described, DescribedRequest)
                await self.window.acquire()
                task = asyncio.create_task(self._run_here(described, served))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            waits = list(self.tasks)
            if self.part is not None:
                await self.part.requests.put(None)  # the part half-closes
                assert self.part.task is not None
                waits.append(self.part.task)
            if waits:
                await asyncio.gather(*waits)
        finally:
            self.outbox.put(None)

    async def _run_here(self, described: DescribedRequest, served: ServedVersion) -> None:
        """One request run here, its response (or its error's) put for the caller."""
        answered = AnsweredHere()
        opened = dataclasses.replace(self.opened, timeout=self.context.time_remaining())
        call = _InStream(answered, 0, opened, served, described, self.here.serving, self.call)
        call.start()
        try:
            data, status = await answered.done
        except asyncio.CancelledError:
            call.cancel()
            raise
        if status.code is not grpc.StatusCode.OK:
            text = f"{status.code.name}: {status.details}"
            data = stream_responses.error(described, text).SerializeToString()
        await self.outbox.room()
        self.outbox.put((data, True))

    async def _pass_on(self, message: bytes) -> None:
        part = self.part
        if part is None:
            opened = dataclasses.replace(
                self.opened,
                transport=self.opened.transport + PART,
                timeout=self.context.time_remaining(),
                metadata=carried(self.call, self.opened.metadata),
            )
            part = self.part = _Part(functools.partial(self.here.open_part, opened))
            part.task = asyncio.create_task(self._take_part(part))
        part.in_flight += 1
        await part.requests.put(message)

    async def _take_part(self, part: _Part) -> None:
        """The part's responses, put for the caller as they come; a part that ends in
        error ends the caller's stream with its status. Its events are closed here, whatever
        this waits on when cancelled: their end is what tells the parent."""
        async with contextlib.aclosing(part.events):
            await self._put_part(part)

    async def _put_part(self, part: _Part) -> None:
        async for kind, value in part.events:
            if kind is Kind.MESSAGE:
                data, last = stream_parts.decode(value)
                if data is not None:
                    await self.outbox.room()
                    self.outbox.put((data, False))
                if last:
                    part.in_flight -= 1
            elif kind is Kind.STATUS and value.code is not grpc.StatusCode.OK:
                self.failed = value
                if self.reader is not None:
                    self.reader.cancel()  # its end puts the stream's
                for task in list(self.tasks):
                    task.cancel()


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
