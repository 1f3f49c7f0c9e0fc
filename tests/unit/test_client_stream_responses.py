"""The numpy client's reading of ModelStreamInfer responses (which one ends its request, an
error for one request) and the generation text they carry (tokens are bytes: a character may
span two of them)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.generation import Chunk, GenerationError, chunks, generation_request
from clients.streaming import (
    EMPTY_FINAL_RESPONSE,
    FINAL_RESPONSE,
    StreamResponse,
    parse_stream_response,
)
from clients.tensors import parse_response
from protos.inference import grpc_service_pb2 as pb

PROPERTY = settings(derandomize=True, max_examples=60, deadline=None)


def token_response(
    delta: bytes | None, final: bool | None, finish: bytes | None = None
) -> pb.ModelStreamInferResponse:
    """A response as the server sends one: `final` None leaves the parameter out."""
    infer = pb.ModelInferResponse(model_name="generate", model_version="1", id="g")
    for name, value in (("text_delta", delta), ("finish_reason", finish)):
        if value is not None:
            infer.outputs.add(name=name, datatype="BYTES", shape=[1])
            infer.raw_output_contents.append(len(value).to_bytes(4, "little") + value)
    if final is not None:
        infer.parameters[FINAL_RESPONSE].bool_param = final
    return pb.ModelStreamInferResponse(infer_response=infer)


def test_final_response_parameter_and_its_absence() -> None:
    assert parse_stream_response(token_response(b"a", False)).final is False
    assert parse_stream_response(token_response(b"a", True)).final is True
    # A model that is not decoupled answers once: without the parameter, that is the last.
    only = parse_stream_response(token_response(b"a", None))
    assert only.final is True and FINAL_RESPONSE not in only.parameters
    assert only.outputs["text_delta"].tolist() == [b"a"]


def test_an_error_names_its_request_and_may_be_non_final() -> None:
    message = token_response(None, False)
    message.error_message = "INTERNAL: the model failed"
    response = parse_stream_response(message)
    assert (response.request_id, response.error, response.final) == (
        "g",
        "INTERNAL: the model failed",
        False,
    )
    message.infer_response.parameters.clear()
    assert parse_stream_response(message).final is True


def test_a_generation_request_asks_for_the_empty_final_response() -> None:
    message = generation_request("generate", "héllo", 7, temperature=0.5, seed=3).message()
    assert message.parameters[EMPTY_FINAL_RESPONSE].bool_param is True
    assert [(t.name, t.datatype, list(t.shape)) for t in message.inputs] == [
        ("text", "BYTES", [1]),
        ("max_tokens", "INT32", [1]),
        ("temperature", "FP32", [1]),
        ("seed", "INT64", [1]),
    ]
    echoed = pb.ModelInferResponse(raw_output_contents=message.raw_input_contents)
    echoed.outputs.extend(
        pb.ModelInferResponse.InferOutputTensor(name=t.name, datatype=t.datatype, shape=t.shape)
        for t in message.inputs
    )
    values = parse_response(echoed)
    assert values["text"].tolist() == ["héllo".encode()]
    assert (int(values["max_tokens"][0]), int(values["seed"][0])) == (7, 3)
    greedy = generation_request("generate", "x", 1).message()
    assert [t.name for t in greedy.inputs] == ["text", "max_tokens"]


async def _chunks(responses: list[StreamResponse]) -> list[Chunk]:
    async def produced() -> AsyncIterator[StreamResponse]:
        for response in responses:
            yield response

    return [chunk async for chunk in chunks(produced())]


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@PROPERTY
@given(
    text=st.text(max_size=20),
    cuts=st.lists(st.integers(0, 80), max_size=12),
    empty_final=st.booleans(),
)
def test_text_deltas_rejoin_whatever_the_token_boundaries(
    text: str, cuts: list[int], empty_final: bool
) -> None:
    """Split the UTF-8 bytes anywhere (inside characters too): the chunks add up to the text,
    and the finish reason comes last."""
    tokens = _split(text.encode(), cuts)
    messages = [token_response(t, False) for t in tokens[:-1]]
    if empty_final:
        messages += [token_response(tokens[-1], False), token_response(None, True, b"length")]
    else:
        messages.append(token_response(tokens[-1], True, b"length"))
    got = asyncio.run(_chunks([parse_stream_response(m) for m in messages]))
    assert "".join(c.text for c in got) == text
    assert [c.finish_reason for c in got] == [None] * (len(got) - 1) + ["length"]


def test_a_truncated_character_at_the_end_is_replaced_not_lost() -> None:
    got = asyncio.run(_chunks([parse_stream_response(token_response("é".encode()[:1], True))]))
    assert got == [Chunk("\ufffd", None)]


def test_an_error_response_raises() -> None:
    message = token_response(None, True)
    message.error_message = "UNAVAILABLE: the worker died after 3 responses were delivered"
    responses = [parse_stream_response(token_response(b"a", False)), parse_stream_response(message)]
    with pytest.raises(GenerationError, match="3 responses"):
        asyncio.run(_chunks(responses))
