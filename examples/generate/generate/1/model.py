"""A decoupled Triton Python model that streams text from a small decoder-only language model
(random weights: the text is gibberish, but a real architecture runs): one response per token
with `text_delta`, then a final one with `finish_reason` (`length` or `stop`).

The work is paddlequic's generation engine (service/backend/generation), which batches the
decode steps of every request in flight; execute() only validates and queues each request and
returns None, as Triton's decoupled models do. Parameters (config.pbtxt): generation_max_batch,
generation_token_budget, generation_mode (docs/generation.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

from service.backend.generation.decoder import PaddleDecoder
from service.backend.generation.engine import GenerationEngine, limits_from
from service.backend.generation.tokenizer import CharTokenizer

HERE = Path(__file__).parent


class Responses:
    """The engine's responses as this model's pb_utils objects."""

    def __init__(self, tokenizer: CharTokenizer) -> None:
        self.tokenizer = tokenizer

    def token(self, token: int) -> Any:
        return _response("text_delta", self.tokenizer.decode(token))

    def final(self, reason: str) -> Any:
        return _response("finish_reason", reason)

    def error(self, message: str) -> Any:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        limits = limits_from(parameters)
        # One token per character (CharTokenizer), and a step takes at most token_budget of
        # them: a longer prompt is refused by its size, before it is decoded or tokenized (a
        # 60 MB one, tokenized first, once held every generation stream for 3.6 s).
        self.max_prompt_chars = limits.token_budget
        self.tokenizer = CharTokenizer(HERE / "vocab.json")
        decoder = PaddleDecoder(HERE / "lm", parameters, limits.max_batch, args["model_name"])
        self.engine = GenerationEngine(decoder, limits, Responses(self.tokenizer))

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            try:
                self.engine.submit(request, *self._read(request), stop_ids=[self.tokenizer.eos])
            except ValueError as exc:
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                    ),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )

    def finalize(self) -> None:
        self.engine.close()

    def _read(self, request: Any) -> tuple[list[int], int, float, int | None]:
        text, max_tokens = _scalar(request, "text"), _scalar(request, "max_tokens")
        if text is None or max_tokens is None:
            raise ValueError("inputs text and max_tokens are required")
        most = self.max_prompt_chars
        if isinstance(text, bytes):
            if len(text) > 4 * most:  # UTF-8: at most 4 bytes a character
                raise ValueError(f"the prompt has {len(text)} bytes, more than {4 * most}")
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError("text must be UTF-8") from None
        text = str(text)
        if len(text) > most:
            raise ValueError(
                f"the prompt has {len(text)} characters, more than the token budget of a step "
                f"({most})"
            )
        temperature = _scalar(request, "temperature")
        seed = _scalar(request, "seed")
        return (
            self.tokenizer.encode(text),
            int(max_tokens),
            0.0 if temperature is None else float(temperature),
            None if seed is None else int(seed),
        )


def _scalar(request: Any, name: str) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise ValueError(f"input {name} must hold one value, not {values.size}")
    return values[0]


def _response(name: str, text: str) -> Any:
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor(name, np.array([text.encode()], dtype=np.object_))]
    )
