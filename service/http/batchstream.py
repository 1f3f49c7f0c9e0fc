"""`POST /v1/inference/advanced/batchstream`: a body of newline-delimited JSON requests
(`{"request_id", "prompt", "max_tokens"?, "model"?, "temperature"?, "seed"?, "stop"?}`),
answered as server-sent events, one per request: `event: completion` with its text, or `event:
error` naming it (`{"request_id": "req-002", "code": "invalid_prompt", "message": ...}`), in
the order the requests end; `event: done` with the counts once the body ended and every request
did.

A request starts as soon as its line arrives, not after the body ends. The route is the only
reader of its request, so it sees the client leave while the body is still coming, and a
client that leaves cancels every request of its stream. Bounds, each per stream and named in
the error event it causes: lines per body, bytes per line, requests generating at once (a line
past it is refused, not queued: the body is always read, so that a departure is seen)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from service.dataplane.plane import InferencePlane
from service.http.json_outputs import dumps
from service.http.json_tensors import MAX_ID_CHARS, parsed
from service.http.ndjson import Line, LineSplitter
from service.http.openai_requests import OpenAIError, completion_request
from service.http.reply import Reply
from service.http.textgen import generation
from service.inference import errors
from service.registry.versions import ServedVersion

MAX_LINES = 1024  # request lines per body
MAX_LINE_BYTES = 64 << 10  # per line
MAX_IN_FLIGHT = 16  # requests of one stream generating at once
# What a line may hold besides request_id: the completion fields this route serves.
_FIELDS = frozenset({"prompt", "max_tokens", "model", "temperature", "seed", "stop"})

Message = dict[str, Any]


@dataclass(frozen=True)
class BatchStreams:
    """Over any inference plane, as Completions: the server's, or a front-end's when it
    serves every generation model itself."""

    plane: InferencePlane
    # The generation model a line names (textgen.generation_model, or a front-end's), and the
    # names of every generation model served (a line naming none takes the only one).
    resolve: Callable[[str], Awaitable[ServedVersion]]
    names: Callable[[], Sequence[str]]
    idle_s: float  # the body may send nothing this long while no request of it generates

    def reply(self, receive: Callable[[], Awaitable[Message]], client: str) -> Reply:
        """`client`: whom its requests count against for the fair share of a model's places."""
        stream = _BatchStream(self, receive, client)
        return Reply(200, events=stream.events(), gone=stream.gone)


def event(name: str, document: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(document) + b"\n\n"


class _Failed(Exception):
    """A line's request refused: its error event's code and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _BatchStream:
    def __init__(
        self, streams: BatchStreams, receive: Callable[[], Awaitable[Message]], client: str
    ) -> None:
        self.streams = streams
        self.receive = receive
        self.client = client
        self.idle_s = streams.idle_s
        self.events_ready: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.running: dict[asyncio.Task[None], str] = {}  # request task -> its request_id
        self.lines = LineSplitter(MAX_LINE_BYTES)
        self.body_done = asyncio.Event()
        self.left = asyncio.Event()  # the client went away
        self.completed = self.failed = 0

    async def gone(self) -> Message:
        """What the app waits on for the client's departure (this route reads the request)."""
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def events(self) -> AsyncGenerator[bytes, None]:
        reader = asyncio.ensure_future(self._read())
        closer = asyncio.ensure_future(self._close_when_done())
        try:
            while (chunk := await self.events_ready.get()) is not None:
                yield chunk
        finally:
            tasks = [reader, closer, *self.running]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _close_when_done(self) -> None:
        await self.body_done.wait()
        while self.running:
            await asyncio.wait(set(self.running))
        counts = {"requests": self.completed + self.failed, "completed": self.completed}
        self.events_ready.put_nowait(event("done", {**counts, "failed": self.failed}))
        self.events_ready.put_nowait(None)

    async def _read(self) -> None:
        """The body, a chunk at a time, each line's request started as it completes; then the
        request's next message, which says the client left."""
        pending = asyncio.ensure_future(self.receive())
        try:
            while True:
                # The timer runs from the last chunk and, while requests generate, starts
                # again when it fires: silent with none generating, at most twice idle_s.
                waiting = None if self.body_done.is_set() else self.idle_s
                done, _ = await asyncio.wait({pending}, timeout=waiting)
                if not done:
                    if not self.running:  # idle, nothing generating
                        self._refuse_rest(
                            "body_timeout",
                            f"the body sent nothing for {self.idle_s:g} s while no request of "
                            "it was generating (--http-body-timeout)",
                        )
                    continue
                message = pending.result()
                if message["type"] == "http.disconnect":
                    self.left.set()
                    return
                pending = asyncio.ensure_future(self.receive())
                if self.body_done.is_set():
                    continue  # the rest of a body refused past its bound
                lines = self.lines.feed(message.get("body", b""))
                if not message.get("more_body", False):
                    lines += self.lines.end()
                for line in lines:
                    self._start(line)
                if not message.get("more_body", False):
                    self.body_done.set()
        finally:
            pending.cancel()

    def _refuse_rest(self, code: str, message: str) -> None:
        self._error(None, None, code, message)
        self.body_done.set()

    def _start(self, line: Line) -> None:
        if self.body_done.is_set():
            return
        if line.number > MAX_LINES:
            self._refuse_rest(
                "too_many_lines",
                f"the body has more than {MAX_LINES} request lines; the rest is not read",
            )
            return
        request_id: str | None = None
        try:
            if line.data is None:
                raise _Failed(
                    "line_too_long", f"line {line.number} has more than {MAX_LINE_BYTES} bytes"
                )
            document = _document(line.data)
            request_id = _request_id(document)
            if len(self.running) >= MAX_IN_FLIGHT:
                raise _Failed(
                    "too_many_in_flight",
                    f"{MAX_IN_FLIGHT} requests of this stream are generating, the most one "
                    "stream may run at once; send it again once one ends",
                )
            if request_id in self.running.values():
                raise _Failed(
                    "duplicate_request_id", "a request of this stream with that id is generating"
                )
            fields = self._request(document)
        except _Failed as exc:
            self._error(request_id, line.number, exc.code, exc.message)
            return
        task = asyncio.ensure_future(self._generate(request_id, line.number, fields))
        self.running[task] = request_id
        task.add_done_callback(self.running.pop)

    def _request(self, document: dict[str, Any]) -> dict[str, Any]:
        """The line's fields as a completion request's (its model the only generation model
        when it names none)."""
        fields = {k: v for k, v in document.items() if k != "request_id"}
        unknown = sorted(fields.keys() - _FIELDS)
        if unknown:
            raise _Failed(
                "unsupported_field",
                f"unknown field '{errors.echoed(unknown[0])}'; a line takes request_id and "
                f"{', '.join(sorted(_FIELDS))}",
            )
        if not isinstance(fields.get("prompt"), str):
            raise _Failed("invalid_prompt", "'prompt' must be a string")
        if "model" not in fields:
            names = self.streams.names()
            if len(names) != 1:
                raise _Failed(
                    "model_required",
                    f"the server has {len(names)} generation models: name one in 'model'",
                )
            fields["model"] = names[0]
        return fields

    async def _generate(self, request_id: str, number: int, fields: dict[str, Any]) -> None:
        try:
            request = completion_request(fields, chat=False)
            served = await self.streams.resolve(request.model)
            started = await generation(self.streams.plane, served, request.sampling, self.client)
            text, reason = await started.collected()
        except OpenAIError as exc:
            code = f"invalid_{exc.param}" if exc.param in _FIELDS else exc.kind
            self._error(request_id, number, code, exc.message)
            return
        except errors.ServiceError as exc:
            self._error(request_id, number, exc.code.name.lower(), exc.message)
            return
        self.completed += 1
        completion = {
            "request_id": request_id,
            "model": served.name,
            "text": text,
            "finish_reason": reason,
            "usage": started.usage(),
        }
        self.events_ready.put_nowait(event("completion", completion))

    def _error(self, request_id: str | None, number: int | None, code: str, message: str) -> None:
        self.failed += request_id is not None or number is not None
        document = {"request_id": request_id, "line": number, "code": code, "message": message}
        self.events_ready.put_nowait(event("error", document))


def _document(data: bytes) -> dict[str, Any]:
    try:
        document = parsed(data)
    except errors.ServiceError as exc:
        raise _Failed("invalid_json", exc.message) from None
    if not isinstance(document, dict):
        raise _Failed("invalid_json", "a line must be a JSON object")
    return document


def _request_id(document: dict[str, Any]) -> str:
    request_id = document.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise _Failed("invalid_request_id", "'request_id' must be a non-empty string")
    if len(request_id) > MAX_ID_CHARS:
        raise _Failed(
            "invalid_request_id",
            f"'request_id' has {len(request_id)} characters; at most {MAX_ID_CHARS}",
        )
    return request_id
