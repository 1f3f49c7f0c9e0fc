"""What decoding a request costs: bounded by the shapes it declares, never by what came with
them. Counted, not timed: the length prefixes the BYTES walk reads, the bytes the validator
allocates on its way to a refusal (tracemalloc), and whether the event loop ran while a large
request was decoded."""

from __future__ import annotations

import asyncio
import struct
import tracemalloc

import grpc
import numpy as np
import pytest
from google.protobuf import text_format
from hypothesis import given
from hypothesis import strategies as st

from oip.bytes_tensor import deserialize_bytes, scan_bytes, serialize_bytes
from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.inference.errors import ECHO_LIMIT, ServiceError
from service.inference.validation import (
    CONVERT_CHUNK,
    INLINE_DECODE_ELEMENTS,
    RequestValidator,
    decoded,
)
from tests.unit.test_validation import property_settings

TEXT = text_format.Parse(
    """
    name: "text" max_batch_size: 4
    input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] },
            { name: "ids" data_type: TYPE_INT32 dims: [ 1 ] } ]
    output [ { name: "label" data_type: TYPE_STRING dims: [ 1 ] } ]
    """,
    mc.ModelConfig(),
)
# A BYTES input whose shape may declare many elements, for decoding that is heavy by right.
WIDE = text_format.Parse(
    """
    name: "wide" max_batch_size: 1
    input [ { name: "text" data_type: TYPE_STRING dims: [ -1 ] } ]
    output [ { name: "label" data_type: TYPE_STRING dims: [ 1 ] } ]
    """,
    mc.ModelConfig(),
)
# Allocated on the way to a refusal besides the one copy of raw contents out of the message
# (which receiving them cost already): the error and its message.
SLACK_BYTES = 8 << 10
EMPTY = b"\0\0\0\0"  # one empty BYTES element


def reference_elements(data: bytes) -> list[bytes] | None:
    """Every element of a serialized BYTES tensor, walked to the end (None: malformed)."""
    elements, offset = [], 0
    while offset < len(data):
        if offset + 4 > len(data):
            return None
        (size,) = struct.unpack_from("<I", data, offset)
        if offset + 4 + size > len(data):
            return None
        elements.append(data[offset + 4 : offset + 4 + size])
        offset += 4 + size
    return elements


PAYLOADS = st.one_of(
    st.binary(max_size=64),
    st.builds(
        lambda elements, tail: serialize_bytes(elements) + tail,
        st.lists(st.binary(max_size=3), max_size=80),
        st.one_of(st.just(b""), st.binary(max_size=6)),
    ),
    st.integers(0, 200_000).map(lambda n: EMPTY * n),  # an element bomb
)


@property_settings(300)
@given(count=st.integers(0, 64), data=PAYLOADS)
def test_the_bytes_walk_reads_no_more_lengths_than_the_shape_declares(
    count: int, data: bytes
) -> None:
    scan = scan_bytes(data, count)
    assert scan.lengths_read <= count
    elements = reference_elements(data)
    assert scan.matches(count) == (elements is not None and len(elements) == count)
    if scan.matches(count):
        assert deserialize_bytes(data, count) == elements
    else:
        with pytest.raises(ValueError):
            deserialize_bytes(data, count)


def refused_allocating(request: pb.ModelInferRequest, config: mc.ModelConfig = TEXT) -> int:
    """Bytes the validator allocated at its peak on its way to INVALID_ARGUMENT."""
    validator = RequestValidator(config)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        with pytest.raises(ServiceError) as refused:
            validator.validate(request)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    return peak


def text_request(shape: list[int] | None = None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="text")
    request.inputs.add(name="text", datatype="BYTES", shape=shape or [1, 1])
    request.inputs.add(name="ids", datatype="INT32", shape=[1, 1])
    return request


def raw_bomb(n: int) -> pb.ModelInferRequest:
    """[1, 1] declared, n elements sent."""
    request = text_request()
    request.raw_input_contents.extend([EMPTY * n, bytes(4)])
    return request


def typed_bomb(n: int) -> pb.ModelInferRequest:
    request = text_request()
    request.inputs[0].contents.bytes_contents.extend([b"x"] * n)
    request.inputs[1].contents.int_contents.append(1)
    return request


def typed_int_bomb(n: int) -> pb.ModelInferRequest:
    request = text_request()
    request.inputs[0].contents.bytes_contents.append(b"x")
    request.inputs[1].contents.int_contents.extend([7] * n)
    return request


def rank_bomb(n: int) -> pb.ModelInferRequest:
    request = text_request([1] * n)
    request.raw_input_contents.extend([EMPTY, bytes(4)])
    return request


def outputs_bomb(n: int) -> pb.ModelInferRequest:
    request = raw_bomb(1)
    for _ in range(n):
        request.outputs.add(name="label")
    return request


def inputs_bomb(n: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="text")
    for _ in range(n):
        request.inputs.add(name="ids", datatype="INT32", shape=[1, 1])
        request.raw_input_contents.append(bytes(4))
    return request


BOMBS = {
    "raw BYTES elements": raw_bomb,
    "typed BYTES values": typed_bomb,
    "typed INT32 values": typed_int_bomb,
    "rank": rank_bomb,
    "requested outputs": outputs_bomb,
    "inputs": inputs_bomb,
}


@property_settings(40)
@given(kind=st.sampled_from(sorted(BOMBS)), n=st.integers(2_000, 60_000))
def test_refusing_a_bomb_allocates_nothing_per_sent_entry(kind: str, n: int) -> None:
    """A request declaring one element (or one output, one input) and sending n: besides the
    raw contents copied out of the message, the refusal allocates a constant."""
    request = BOMBS[kind](n)
    copied = sum(len(raw) for raw in request.raw_input_contents)
    assert refused_allocating(request) <= copied + SLACK_BYTES


@pytest.mark.parametrize(
    ("where", "expected"),
    [("input", "has no input"), ("output", "has no output"), ("datatype", "got")],
)
def test_error_messages_quote_a_bounded_part_of_the_callers_strings(
    where: str, expected: str
) -> None:
    huge = "n" * (1 << 20)
    request = raw_bomb(1)
    if where == "input":
        request.inputs[0].name = huge
    elif where == "output":
        request.outputs.add(name=huge)
    else:
        request.inputs[0].datatype = huge
    with pytest.raises(ServiceError) as refused:
        RequestValidator(TEXT).validate(request)
    assert expected in refused.value.message
    assert f"({len(huge)} characters)" in refused.value.message
    assert len(refused.value.message) < ECHO_LIMIT + 512


def wide_request(n: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="wide")
    request.inputs.add(name="text", datatype="BYTES", shape=[1, n])
    request.raw_input_contents.append(serialize_bytes([b"ab"] * n))
    return request


async def loop_turns_while(decoding_of: pb.ModelInferRequest) -> int:
    """How many times another task ran on this event loop while the request was decoded."""
    decoding = RequestValidator(WIDE).admit(decoding_of)
    turns = 0
    stop = asyncio.Event()

    async def other_task() -> None:
        nonlocal turns
        while not stop.is_set():
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_task())
    await asyncio.sleep(0)
    before = turns
    job = await decoded(decoding)
    during = turns - before
    stop.set()
    await task
    assert job.inputs[0].data == decoding_of.raw_input_contents[0]
    return during


@pytest.mark.parametrize("elements", [4 * INLINE_DECODE_ELEMENTS, 64 * INLINE_DECODE_ELEMENTS])
async def test_heavy_decoding_runs_off_the_event_loop(elements: int) -> None:
    assert RequestValidator(WIDE).admit(wide_request(elements)).work == elements
    assert await loop_turns_while(wide_request(elements)) > 0


async def test_light_decoding_stays_on_the_event_loop() -> None:
    request = wide_request(INLINE_DECODE_ELEMENTS)
    assert await loop_turns_while(request) == 0


def test_raw_numeric_contents_cost_no_decoding_and_are_not_copied() -> None:
    request = pb.ModelInferRequest(model_name="text")
    request.inputs.add(name="text", datatype="BYTES", shape=[4, 1])
    request.inputs.add(name="ids", datatype="INT32", shape=[4, 1])
    request.raw_input_contents.extend([EMPTY * 4, bytes(range(16))])
    decoding = RequestValidator(TEXT).admit(request)
    assert [c.work for c in decoding.inputs] == [4, 0]
    ids = decoding.inputs[1].decode()
    assert ids == bytes(range(16)) and ids is decoding.inputs[1].decode()


IDS = text_format.Parse(
    """
    name: "ids" max_batch_size: 1
    input [ { name: "ids" data_type: TYPE_INT16 dims: [ -1 ] } ]
    output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
    """,
    mc.ModelConfig(),
)


@property_settings(10)
@given(
    count=st.integers(CONVERT_CHUNK, 3 * CONVERT_CHUNK + 7),
    bad_at=st.one_of(st.none(), st.integers(0, 3 * CONVERT_CHUNK)),
)
def test_typed_values_convert_a_chunk_at_a_time_as_one_array_would(
    count: int, bad_at: int | None
) -> None:
    """Converted in chunks (so a thread's conversion lets the event loop run), the values come
    out as converting them at once would, and a value that does not fit INT16 in any chunk is
    refused."""
    values = [(i * 7919) % 65536 - 32768 for i in range(count)]
    if bad_at is not None and bad_at < count:
        values[bad_at] = 1 << 15
    request = pb.ModelInferRequest(model_name="ids")
    request.inputs.add(name="ids", datatype="INT16", shape=[1, count])
    request.inputs[0].contents.int_contents.extend(values)
    decoding = RequestValidator(IDS).admit(request)
    assert decoding.work == count
    if bad_at is not None and bad_at < count:
        with pytest.raises(ServiceError) as refused:
            decoding.finish()
        assert refused.value.message == "input 'ids': a value does not fit INT16"
        return
    assert decoding.finish().inputs[0].data == np.asarray(values, "<i2").tobytes()
