"""ModelStreamInfer: requests run concurrently and answer in completion order (correlate by
id); a failed request yields an error_message and the stream goes on. A decoupled model's
request answers with zero to many responses, interleaved with the others', each with
`triton_final_response` (true on its last).

A request holds its slot in the window until its final response was taken by the transport
(the generator resumes only then), so a client that stops reading stops being read: the
request iterator waits for a slot, and the outbox never holds more than the window nor, but for
one response, more than --stream-buffer-bytes. A decoupled request takes its next response
from its model only once the outbox has room for it, so its model is held too, but not for
long: a caller that takes no response for --stream-stall-timeout has every request of the
stream cancelled (their places and batch slots free), and the stream ends RESOURCE_EXHAUSTED
once the transport takes what it was sending."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import grpc

from protos.inference import grpc_service_pb2 as pb
from service.api import stream_responses
from service.api.callers import client_of
from service.api.request_inference import RequestInference, call_deadline, decode
from service.api.stream_outbox import Outbox, StallWatch, StreamBounds, response_bytes
from service.dataplane.plane import DataPlane
from service.inference import classification, errors
from service.inference.errors import ServicerContext
from service.inference.jobs import StreamAnswer
from service.inference.validation import request_sequence
from service.registry.versions import ModelRegistry, ServedVersion

STREAM_WINDOW = 64  # requests of one stream in flight at once; more wait (backpressure)

# A response to send (None: nothing), and whether it is its request's last.
StreamItem = tuple[pb.ModelStreamInferResponse | None, bool]


@dataclasses.dataclass(frozen=True)
class StreamInference:
    """ModelStreamInfer's streams."""

    plane: DataPlane
    requests: RequestInference  # a request whose model is not decoupled, as ModelInfer's
    stream_bounds: StreamBounds

    async def responses(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: ServicerContext,
    ) -> AsyncGenerator[pb.ModelStreamInferResponse, None]:
        """The stream's responses, as this module's docstring says."""
        async with contextlib.aclosing(self.items(request_iterator, context)) as items:
            async for response, _ in items:
                if response is not None:
                    yield response

    async def items(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: ServicerContext,
    ) -> AsyncGenerator[StreamItem, None]:
        """Each response (None: a request ended with nothing to send) with whether it is its
        request's last: what a front-end that passed these requests on needs to know which
        of them are still in flight (stream_parts.py)."""
        # (response or None: nothing to send, whether it was the request's last)
        outbox: Outbox[StreamItem | None] = Outbox(
            STREAM_WINDOW + 1, self.stream_bounds.buffer_bytes, response_bytes
        )
        window = asyncio.Semaphore(STREAM_WINDOW)
        tasks: set[asyncio.Task[None]] = set()
        deadline = call_deadline(context)
        client = client_of(context)

        # The last request of each sequence on this stream: the next one of it waits for it,
        # so a sequence's requests reach its batcher in the order the stream sent them.
        chains: dict[tuple[str, int | str], asyncio.Task[None]] = {}

        async def put(item: StreamItem) -> None:
            await outbox.room()
            outbox.put(item)

        async def run_one(
            request: pb.ModelInferRequest, previous: asyncio.Task[None] | None
        ) -> None:
            if previous is not None:
                await asyncio.wait({previous})
            try:
                named = (request.model_name, request.model_version)
                async with self.plane.serving(*named, deadline) as served:
                    if served.decoupled:
                        await self._generate(served, request, deadline, client, outbox)
                        return
                    response = pb.ModelStreamInferResponse(
                        infer_response=await self.requests.infer_on(
                            served, request, deadline, context
                        )
                    )
            except errors.ServiceError as exc:
                decoupled = _served_decoupled(self.plane.models, request)
                response = stream_responses.failed(request, exc, decoupled)
            await put((response, True))

        async def read_requests() -> None:
            try:
                while True:
                    await window.acquire()
                    request = await anext(request_iterator, None)
                    if request is None:
                        break
                    key = _sequence_key(request)
                    task = asyncio.create_task(
                        run_one(request, None if key is None else chains.get(key))
                    )
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    if key is not None:
                        chains[key] = task
                        task.add_done_callback(functools.partial(_unchain, chains, key))
                if tasks:
                    await asyncio.gather(*list(tasks))
            finally:
                outbox.put(None)

        cancelled: list[int] = []  # how many requests the stall cancelled

        def stall() -> None:
            """The caller took nothing for stall_s: its requests end now, not when it leaves."""
            cancelled.append(len(tasks))
            self.stream_bounds.on_stall()
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            outbox.clear()

        reader = asyncio.create_task(read_requests())
        watch = StallWatch(self.stream_bounds.stall_s, stall)
        try:
            while (item := await outbox.get()) is not None:
                watch.sending()
                yield item
                watch.sent()
                if watch.stalled:
                    break
                if item[1]:  # the request's last
                    window.release()
            if watch.stalled:
                await errors.abort(context, stalled(self.stream_bounds.stall_s, cancelled[0]))
            await reader
        finally:
            watch.close()
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _generate(
        self,
        served: ServedVersion,
        request: pb.ModelInferRequest,
        deadline: float | None,
        client: str,
        outbox: Outbox[StreamItem | None],
    ) -> None:
        """A decoupled model's responses to one request, put as they come; the last one put
        is final. A ServiceError before or between them ends the request (the caller turns
        it into the request's final error_message)."""
        counts = classification.class_counts(request)
        job = await decode(self.plane, served, request)
        stream = self.plane.runner.stream(
            served, job, request.id, stream_responses.parameters(request), deadline, client
        )
        async for item in generated(stream, served, request, outbox.room, counts):
            outbox.put(item)


async def generated(
    answers: AsyncGenerator[StreamAnswer, None],
    served: ServedVersion,
    request: pb.ModelInferRequest,
    room: Callable[[], Awaitable[None]],
    counts: dict[str, int] | None = None,
) -> AsyncGenerator[StreamItem, None]:
    """A decoupled request's answers as its stream's items, the last one final (closing
    this closes `answers`). Each is built only once `room()` returns: a response repeats the
    request's id, and one built per token while the caller does not read would hold that id
    once per token. `counts`: the outputs to classify (classification.class_counts)."""
    empty_final = stream_responses.empty_final_wanted(request)
    version = str(served.version)
    async with contextlib.aclosing(answers) as each:
        async for answer in each:
            if counts and answer.outputs:
                answer = dataclasses.replace(
                    answer, outputs=served.classified(answer.outputs, counts)
                )
            await room()
            response = stream_responses.decoupled(
                served.name, version, request, answer, empty_final
            )
            yield response, answer.final


def _served_decoupled(models: ModelRegistry, request: pb.ModelInferRequest) -> bool:
    """Whether the request names a decoupled model (its error is then its final response)."""
    try:
        return models.resolve(request.model_name, request.model_version).decoupled
    except errors.ServiceError:
        return False


def _sequence_key(request: pb.ModelInferRequest) -> tuple[str, int | str] | None:
    """The sequence a stream's request belongs to (None: none, or parameters that its model
    will refuse)."""
    try:
        flags = request_sequence(request)
    except errors.ServiceError:
        return None
    return None if flags is None else (request.model_name, flags.corrid)


def _unchain(
    chains: dict[tuple[str, int | str], asyncio.Task[None]],
    key: tuple[str, int | str],
    task: asyncio.Task[None],
) -> None:
    if chains.get(key) is task:
        del chains[key]


def stalled(stall_s: float, cancelled: int) -> errors.ServiceError:
    return errors.ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the caller took no response of this stream for {stall_s:g} s "
        f"(--stream-stall-timeout); its {cancelled} request(s) in flight were cancelled",
    )
