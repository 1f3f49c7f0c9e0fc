"""Text generation over the data plane, for the routes that speak in prompts and completions
(the OpenAI-compatible API, batchstream) rather than in tensors: a prompt and its sampling
become the inputs of a generation model's request, as Triton's generate extension builds them,
and the model's responses a stream of text pieces, cut at a stop sequence.

A generation model is one with the generation engine's interface (docs/generation.md):
decoupled, inputs `text` (BYTES) and `max_tokens` (INT32), optional `temperature` (FP32) and
`seed` (INT64), outputs `text_delta` and `finish_reason` (BYTES), one response per token. That
interface is its declaration: no other model is offered as one."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import grpc

from protos.inference import model_config_pb2 as mc
from service.dataplane.plane import DataPlane, InferencePlane
from service.http.generate import GenerateRequest, TextDecoder, generate_inputs
from service.inference import errors
from service.inference.errors import echoed
from service.inference.jobs import StreamAnswer
from service.inference.validation import Decoding
from service.registry.versions import ModelRegistry, ServedVersion

_INPUTS = {"text": mc.TYPE_STRING, "max_tokens": mc.TYPE_INT32}
_OPTIONAL = {"temperature": mc.TYPE_FP32, "seed": mc.TYPE_INT64}
_OUTPUTS = {"text_delta": mc.TYPE_STRING, "finish_reason": mc.TYPE_STRING}
CHAT_TEMPLATE = "chat_template"  # the model config parameter a chat prompt is built with


@dataclass(frozen=True)
class Sampling:
    """One generation's request, checked by the route that read it."""

    prompt: str
    max_tokens: int
    temperature: float | None  # None: the model's default (greedy)
    seed: int | None
    stop: tuple[str, ...] = ()  # the text ends before the first of these, and so does the model


@dataclass(frozen=True)
class Piece:
    """Text to send, and on the last piece why the generation ended (`length` or `stop`)."""

    text: str
    finish_reason: str | None = None


def serves_generation(config: mc.ModelConfig) -> bool:
    """Whether the model has the generation interface (and so serves the text routes)."""
    if not config.model_transaction_policy.decoupled:
        return False
    inputs = {t.name: t for t in config.input}
    outputs = {t.name: t.data_type for t in config.output}
    required = all(
        name in inputs and inputs[name].data_type == kind and not inputs[name].optional
        for name, kind in _INPUTS.items()
    )
    others = all(
        name in _OPTIONAL and inputs[name].data_type == _OPTIONAL[name] and inputs[name].optional
        for name in inputs.keys() - _INPUTS.keys()
    )
    return required and others and all(outputs.get(n) == k for n, k in _OUTPUTS.items())


async def generation_model(plane: DataPlane, name: str) -> ServedVersion:
    """The model's serving version, if it is a generation model (NOT_FOUND otherwise); under
    --model-memory-budget loaded first if it is not in memory."""
    await plane.in_memory(name, None)
    return generation_checked(plane.resolve(name, ""), name)


def generation_checked(served: ServedVersion, name: str) -> ServedVersion:
    """`served` (the version `name` resolved to), if it is a generation model's."""
    if not serves_generation(served.config):
        raise errors.ServiceError(
            grpc.StatusCode.NOT_FOUND,
            f"model '{echoed(name)}' is not a generation model (a decoupled model with inputs "
            "text and max_tokens and outputs text_delta and finish_reason); GET /v1/models "
            "lists those served",
        )
    return served


def generation_models(models: ModelRegistry) -> list[ServedVersion]:
    """The serving version of each generation model, by name."""
    chosen: dict[str, ServedVersion] = {}
    for served in models.all_versions():
        if served.ready and serves_generation(served.config):
            latest = chosen.get(served.name)
            if latest is None or served.version > latest.version:
                chosen[served.name] = served
    return list(chosen.values())


def chat_template(served: ServedVersion) -> str | None:
    """The template the model declares for chat prompts (None: it declares none)."""
    parameter = served.config.parameters.get(CHAT_TEMPLATE)
    return parameter.string_value if parameter is not None else None


class StopScanner:
    """Where the text ends for a set of stop sequences, fed a piece at a time: the end of the
    text that could start a stop sequence is held back until the next piece says whether it
    does."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that may be sent now, and whether a stop sequence ended it."""
        if not self.stop:
            return text, False
        self.held += text
        # The stop sequence that completes first wins (at a tie, the one that starts first):
        # what a stream can know, however its pieces split the text.
        found = [(i + len(s), i) for s in self.stop if (i := self.held.find(s)) >= 0]
        if found:
            ready, self.held = self.held[: min(found)[1]], ""
            return ready, True
        keep = max(
            (k for s in self.stop for k in range(1, len(s)) if self.held.endswith(s[:k])),
            default=0,
        )
        cut = len(self.held) - keep
        ready, self.held = self.held[:cut], self.held[cut:]
        return ready, False

    def flush(self) -> str:
        """What is held back once the generation ended without a stop sequence."""
        held, self.held = self.held, ""
        return held


class Generation:
    """A generation running in a model: its pieces of text, in order, and the tokens the model
    generated for them (one response per token)."""

    def __init__(
        self,
        served: ServedVersion,
        first: StreamAnswer,
        answers: AsyncGenerator[StreamAnswer, None],
        sampling: Sampling,
    ) -> None:
        # The engine's tokenizer counts a token per character (service/backend/generation).
        self.prompt_tokens = len(sampling.prompt)
        self.tokens = 0
        self.pieces = self._pieces(served, first, answers, sampling.stop)

    async def collected(self) -> tuple[str, str | None]:
        """All of its text, and why it ended."""
        texts, reason = [], None
        async with contextlib.aclosing(self.pieces) as pieces:
            async for piece in pieces:
                texts.append(piece.text)
                reason = piece.finish_reason
        return "".join(texts), reason

    def usage(self) -> dict[str, int]:
        """OpenAI's `usage`, in the model's tokens."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "total_tokens": self.prompt_tokens + self.tokens,
        }

    async def _pieces(
        self,
        served: ServedVersion,
        first: StreamAnswer,
        answers: AsyncGenerator[StreamAnswer, None],
        stop: tuple[str, ...],
    ) -> AsyncGenerator[Piece, None]:
        decoder = TextDecoder()
        scanner = StopScanner(stop)
        version = str(served.version)
        async with contextlib.aclosing(answers) as rest:
            answer: StreamAnswer | None = first
            while answer is not None:
                checked(answer)
                event = decoder.event(served.name, version, answer.outputs, answer.final)
                if "text_delta" in event:
                    self.tokens += 1
                text, stopped = scanner.feed(event.get("text_delta", ""))
                if stopped:
                    yield Piece(text, "stop")
                    return  # leaving the block closes `answers`: the request is cancelled
                reason = event.get("finish_reason")
                if reason is not None or answer.final:
                    yield Piece(text + scanner.flush(), str(reason or "stop"))
                    return
                if text:
                    yield Piece(text)
                answer = await anext(rest, None)
            raise errors.ServiceError(
                grpc.StatusCode.INTERNAL, f"model '{served.name}' ended its stream without a final"
            )


async def generation(
    plane: InferencePlane, served: ServedVersion, sampling: Sampling, client: str
) -> Generation:
    """The generation, started: refused here (its status) if the model refuses it before its
    first response; after that, its errors end `pieces` (ServiceError). Closing `pieces`, or
    reaching a stop sequence, cancels the request in the model. `client`: whom it counts
    against for the fair share of the model's places."""
    inputs: dict[str, object] = {"text": sampling.prompt, "max_tokens": sampling.max_tokens}
    if sampling.temperature is not None:
        inputs["temperature"] = sampling.temperature
    if sampling.seed is not None:
        inputs["seed"] = sampling.seed
    request = GenerateRequest(inputs, {})
    validator = served.validator
    assert validator is not None  # a resolved version serves

    def admit() -> Decoding:
        return validator.check(generate_inputs(request, validator), ())

    job = await plane.admitted(served, admit)
    answers = plane.runner.stream(served, job, "", request.parameters_json, None, client)
    try:
        first = checked(await anext(answers))
    except BaseException:
        await answers.aclose()
        raise
    return Generation(served, first, answers, sampling)


def checked(answer: StreamAnswer) -> StreamAnswer:
    """The answer, unless it is the model's error: then that error, under its status."""
    if answer.error is not None:
        raise errors.ServiceError(grpc.StatusCode[answer.status], answer.error)
    return answer
