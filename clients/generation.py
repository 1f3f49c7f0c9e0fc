"""Text generation over a stream: a prompt and `max_tokens` in, text deltas out as the model
sends them, the finish reason at the end. The model is a decoupled one with the `generate`
example's interface: inputs `text` (BYTES) and `max_tokens` (INT32), optional `temperature`
(FP32) and `seed` (INT64); one response per token with `text_delta` (BYTES), and
`finish_reason` (BYTES: `length` or `stop`) in the final response."""

from __future__ import annotations

import codecs
from collections.abc import AsyncGenerator, AsyncIterable
from dataclasses import dataclass

import numpy as np

from clients.streaming import StreamRequest, StreamResponse

TEXT = "text"
MAX_TOKENS = "max_tokens"
TEMPERATURE = "temperature"
SEED = "seed"
TEXT_DELTA = "text_delta"
FINISH_REASON = "finish_reason"
REQUIRED_INPUTS = (TEXT, MAX_TOKENS)


class GenerationError(Exception):
    """The server or the model failed the generation (its error_message)."""


@dataclass(frozen=True)
class Chunk:
    """What one response added: `text` (may be empty: a token that ends inside a UTF-8
    character waits for the next), and on the last chunk the finish reason."""

    text: str
    finish_reason: str | None = None


def generation_request(
    model: str,
    prompt: str,
    max_tokens: int,
    temperature: float | None = None,
    seed: int | None = None,
    version: str = "",
    request_id: str = "",
) -> StreamRequest:
    """Greedy unless `temperature` is given; `seed` makes sampling repeatable."""
    inputs = {
        TEXT: np.array([prompt.encode()], dtype=object),
        MAX_TOKENS: np.array([max_tokens], dtype=np.int32),
    }
    if temperature is not None:
        inputs[TEMPERATURE] = np.array([temperature], dtype=np.float32)
    if seed is not None:
        inputs[SEED] = np.array([seed], dtype=np.int64)
    return StreamRequest(model, inputs, request_id, version=version, empty_final=True)


def _text(response: StreamResponse, name: str) -> bytes:
    array = response.outputs.get(name)
    return b"" if array is None else b"".join(bytes(v) for v in array.flat)


async def chunks(responses: AsyncIterable[StreamResponse]) -> AsyncGenerator[Chunk, None]:
    """The responses of one generation as text. Tokens are bytes, and a multi-byte character
    may span two of them: the decoder holds a partial one until it is complete."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    async for response in responses:
        if response.error is not None:
            raise GenerationError(response.error)
        text = decoder.decode(_text(response, TEXT_DELTA), final=response.final)
        if not response.final:
            yield Chunk(text)
            continue
        yield Chunk(text, _text(response, FINISH_REASON).decode(errors="replace") or None)
        return
