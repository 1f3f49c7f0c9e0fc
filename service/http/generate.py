"""Triton's generate extension over REST: `POST .../generate` answers one JSON object,
`.../generate_stream` a server-sent event (`data: <json>\\n\\n`) per response of the model.

A request is one JSON object whose keys, but for `id` and `parameters`, name the model's inputs
(`{"text": "Once upon", "max_tokens": 16}`), each a value or a flat list, shaped as the model
declares it (one batch row); `parameters` reach the model as its request parameters. A
response is `{"model_name", "model_version", OUTPUT: value, ...}`, an output of one element
unwrapped. A stream's text outputs are decoded across its responses, so a character that a
token ends inside of comes whole with the next one; an error after the first event comes
in-band as `data: {"error": "..."}`, Triton's framing."""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

from oip.bytes_tensor import deserialize_bytes
from service.http.json_outputs import dumps, output_json
from service.http.json_tensors import MAX_TENSORS, converted, flattened
from service.inference.errors import echoed, invalid
from service.inference.jobs import InputTensor, OutputTensor
from service.inference.validation import RequestValidator

RESERVED = ("id", "parameters")


@dataclass(frozen=True)
class GenerateRequest:
    inputs: Mapping[str, Any]  # input name -> a value or a flat list of values
    parameters: Mapping[str, Any]  # the model's request parameters

    @property
    def parameters_json(self) -> str:
        """As pb_utils' request.parameters() returns them."""
        return json.dumps(self.parameters)


def generate_request(document: Any) -> GenerateRequest:
    if not isinstance(document, dict):
        raise invalid("the request body must be a JSON object")
    parameters = document.get("parameters", {})
    if not isinstance(parameters, dict) or not all(
        isinstance(v, (bool, int, float, str)) for v in parameters.values()
    ):
        raise invalid("'parameters' must be an object of numbers, strings and booleans")
    inputs = {k: v for k, v in document.items() if k not in RESERVED}
    if len(inputs) > MAX_TENSORS:
        raise invalid(f"the request names {len(inputs)} inputs; at most {MAX_TENSORS}")
    return GenerateRequest(inputs, parameters)


def generate_inputs(request: GenerateRequest, validator: RequestValidator) -> list[InputTensor]:
    """Each input shaped as the model declares it, one batch row; a variable dimension (one
    at most) takes what the list holds."""
    tensors = []
    for name, value in request.inputs.items():
        declared = validator.inputs.get(name)
        if declared is None:
            raise invalid(
                f"model '{validator.model}' has no input '{echoed(name)}'; its inputs are "
                f"{sorted(validator.inputs)}"
            )
        values = value if isinstance(value, list) else [value]
        dims = declared.dims
        fixed = math.prod(d for d in dims if d != -1)
        variable = dims.count(-1)
        if variable > 1 or (variable == 1 and len(values) % fixed):
            raise invalid(
                f"input '{name}': shape {list(dims)} cannot be filled from {len(values)} "
                "values by generate; use /infer"
            )
        shape = tuple(len(values) // fixed if d == -1 else d for d in dims)
        if validator.max_batch_size > 0:
            shape = (1, *shape)
        datatype = declared.datatype
        shape = validator.declared_shape(name, datatype.name, shape)
        data = converted(name, flattened(name, values, shape), datatype)
        tensors.append(InputTensor(name, datatype, shape, data))
    return tensors


def event(model: str, version: str, outputs: tuple[OutputTensor, ...]) -> dict[str, Any]:
    """One response as Triton's generate answers it: an output of one element unwrapped."""
    answer: dict[str, Any] = {"model_name": model, "model_version": version}
    for tensor in outputs:
        data = output_json(tensor, False)["data"]
        answer[tensor.name] = data[0] if len(data) == 1 else data
    return answer


class TextDecoder:
    """A stream's single-element text outputs, decoded across its responses: a token may end
    inside a UTF-8 character, whose other bytes come with the next response."""

    def __init__(self) -> None:
        self._decoders: dict[str, codecs.IncrementalDecoder] = {}

    def event(
        self, model: str, version: str, outputs: tuple[OutputTensor, ...], final: bool
    ) -> dict[str, Any]:
        answer = event(model, version, outputs)
        for tensor in outputs:
            if tensor.datatype.name == "BYTES" and math.prod(tensor.shape) == 1:
                decoder = self._decoders.setdefault(
                    tensor.name, codecs.getincrementaldecoder("utf-8")(errors="replace")
                )
                (element,) = deserialize_bytes(tensor.data, 1)
                answer[tensor.name] = decoder.decode(element, final)
        return answer


def sse(document: Mapping[str, Any]) -> bytes:
    return b"data: " + dumps(document) + b"\n\n"


async def single(chunk: bytes) -> AsyncGenerator[bytes, None]:
    yield chunk
