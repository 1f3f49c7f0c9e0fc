"""The OpenAI-compatible API on the generation models, in vLLM's framing: `GET /v1/models`,
`POST /v1/completions` and `POST /v1/chat/completions`, answered as one JSON document or, with
`stream: true`, as server-sent events (`data: <chunk>`), a usage chunk last with
`stream_options.include_usage`, always ending `data: [DONE]`. A route is a conversion: the
generation runs on the data plane as generate_stream's does (service/http/textgen.py).

Errors are `{"error": {"message", "type", "param", "code"}}` under Triton's status mapping
(service/http/status.py); one after the first chunk comes in-band, then `[DONE]`."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol

from service.dataplane.plane import DataPlane, InferencePlane
from service.http.json_outputs import dumps
from service.http.json_tensors import parsed
from service.http.openai_requests import (
    CompletionRequest,
    Messages,
    OpenAIError,
    completion_request,
    rendered,
)
from service.http.reply import Reply
from service.http.status import http_status
from service.http.textgen import (
    Generation,
    Sampling,
    chat_template,
    generation,
    generation_models,
)
from service.inference import errors
from service.registry.versions import ServedVersion

DONE = b"data: [DONE]\n\n"
OWNER = "paddlequic"


def error_document(status: int, message: str, exc: BaseException | None) -> dict[str, Any]:
    """OpenAI's error body: `type` by the status, `param` and `code` from an OpenAIError
    (a refusal from below: its gRPC status name)."""
    kind = (
        "server_error"
        if status >= 500
        else "rate_limit_error"
        if status == 429
        else "invalid_request_error"
    )
    code = None
    if isinstance(exc, OpenAIError):
        code = exc.kind
    elif isinstance(exc, errors.ServiceError):
        code = exc.code.name.lower()
    param = exc.param if isinstance(exc, OpenAIError) else None
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def chunk(document: dict[str, Any]) -> bytes:
    return b"data: " + dumps(document) + b"\n\n"


class Labels(Protocol):
    """What the request log and metrics say of a call (observed.py's Call)."""

    model: str


def models(plane: DataPlane) -> Reply:
    """`GET /v1/models`: the generation models the server serves."""
    listed = [
        {
            "id": served.name,
            "object": "model",
            "created": 0,
            "owned_by": OWNER,
        }
        for served in generation_models(plane.models)
    ]
    return Reply(200, {"object": "list", "data": listed})


class Completions:
    """`POST /v1/completions` and `/v1/chat/completions` over any inference plane: the
    server's, or a front-end's for the generation models it serves itself."""

    def __init__(
        self, plane: InferencePlane, resolve: Callable[[str], Awaitable[ServedVersion]]
    ) -> None:
        """`resolve`: the generation model a request names (textgen.generation_model, or a
        front-end's: PassedOn when it does not serve it)."""
        self.plane = plane
        self.resolve = resolve

    async def completions(self, body: bytes, chat: bool, client: str, call: Labels) -> Reply:
        """`chat`: /v1/chat/completions. `client`: whom the generation counts against for
        the fair share of the model's places; `call`: where the model is named for the
        request log and metrics."""
        request = completion_request(parsed(body), chat)
        call.model = request.model
        served = await self.resolve(request.model)
        sampling = request.sampling
        if isinstance(request.prompt, Messages):
            prompt = rendered(request.prompt, chat_template(served), served.name)
            sampling = Sampling(
                prompt, sampling.max_tokens, sampling.temperature, sampling.seed, sampling.stop
            )
        started = await generation(self.plane, served, sampling, client)
        answer = _Answer(request, served.name, chat)
        if request.stream:
            return Reply(200, events=answer.chunks(started))
        text, reason = await started.collected()
        return Reply(200, answer.whole(text, reason, started))


class _Answer:
    """The documents of one completion: whole, or as the chunks of its stream."""

    def __init__(self, request: CompletionRequest, model: str, chat: bool) -> None:
        self.request = request
        self.chat = chat
        self.head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }

    def whole(self, text: str, reason: str | None, started: Generation) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self.head, "choices": [choice], "usage": started.usage()}

    async def chunks(self, started: Generation) -> AsyncGenerator[bytes, None]:
        """The stream's events; an error after the first comes in-band, then `[DONE]`."""
        head: dict[str, Any] = {
            **self.head,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
        }
        if self.request.include_usage:
            head["usage"] = None
        try:
            async with contextlib.aclosing(started.pieces) as pieces:
                if self.chat:
                    yield chunk({**head, "choices": [self._choice("", None, first=True)]})
                async for piece in pieces:
                    yield chunk(
                        {**head, "choices": [self._choice(piece.text, piece.finish_reason)]}
                    )
        except errors.ServiceError as exc:
            yield chunk(error_document(http_status(exc.code), exc.message, exc))
            yield DONE
            return
        if self.request.include_usage:
            yield chunk({**head, "choices": [], "usage": started.usage()})
        yield DONE

    def _choice(self, text: str, reason: str | None, first: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
        if not self.chat:
            choice["text"] = text
        elif first:
            choice["delta"] = {"role": "assistant", "content": ""}
        else:
            choice["delta"] = {"content": text} if text or reason is None else {}
        return choice
