"""The REST API's JSON tensors at their boundaries, over random inputs: the nesting scan agrees
with a parser on every document, `data` is accepted exactly when it has the declared shape, and
values convert exactly when they fit the datatype."""

from __future__ import annotations

import json
import math
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oip.bytes_tensor import serialize_bytes
from oip.datatypes import BY_NAME
from service.http.encoding import preferred
from service.http.generate import TextDecoder
from service.http.json_depth import nesting_depth
from service.http.json_outputs import dumps, output_json
from service.http.json_tensors import MAX_DEPTH, converted, flattened, parsed
from service.http.status import Restricted, error_status, http_status
from service.inference.errors import ServiceError
from service.inference.jobs import OutputTensor

PROPERTY = settings(derandomize=True, deadline=None)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\n'),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet='[]{}"\\k', max_size=3), inner, max_size=3)
    ),
    max_leaves=30,
)


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None, derandomize=True)
@given(document=JSON, chunk=st.integers(1, 16))
def test_nesting_depth_is_the_parsed_depth(document: Any, chunk: int) -> None:
    """Small chunks: a string, an escape or a bracket run crosses chunk boundaries."""
    for text in (json.dumps(document), json.dumps(document, indent=1)):
        assert nesting_depth(text.encode(), chunk) == depth(document)
        assert nesting_depth(text.encode()) == depth(document)


def test_a_body_nesting_past_the_limit_is_refused_before_parsing() -> None:
    fine = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert parsed(fine) is not None
    with pytest.raises(ServiceError, match=f"nests {MAX_DEPTH + 1} deep"):
        parsed(b"[" + fine + b"]")
    # Unbalanced: refused by its depth, never handed to the parser.
    with pytest.raises(ServiceError, match="nests 1000000 deep"):
        parsed(b"[" * 1_000_000)


SHAPES = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)


@PROPERTY
@given(shape=SHAPES)
def test_data_of_the_shape_flattens_row_major(shape: tuple[int, ...]) -> None:
    values = np.arange(math.prod(shape))
    assert flattened("x", values.reshape(shape).tolist(), shape) == values.tolist()
    assert flattened("x", values.tolist(), shape) == values.tolist()


@PROPERTY
@given(shape=SHAPES, data=st.data())
def test_data_off_the_shape_is_refused(shape: tuple[int, ...], data: st.DataObject) -> None:
    """One list anywhere in the nesting one value short or long, or a flat list of another
    length: refused, whatever the rest holds."""
    nested = np.arange(math.prod(shape)).reshape(shape).tolist()
    axis = data.draw(st.integers(0, len(shape) - 1))
    target = nested
    for _ in range(axis):
        target = target[data.draw(st.integers(0, len(target) - 1))]
    if data.draw(st.booleans()) or len(target) == 1:
        target.append(target[0])
    else:
        target.pop()
    with pytest.raises(ServiceError, match=r"does not have shape|needs"):
        flattened("x", nested, shape)
    flat = list(range(math.prod(shape) + data.draw(st.sampled_from([-1, 1]))))
    with pytest.raises(ServiceError, match="needs"):
        flattened("x", flat, shape)


def test_a_million_values_past_the_shape_cost_one_comparison() -> None:
    """The walk stops at the first list whose length is not the shape's."""
    with pytest.raises(ServiceError, match="'data' holds 1000000"):
        flattened("x", [0] * 1_000_000, (1, 1))
    with pytest.raises(ServiceError, match="dimension 1 holds 1000000, not 1"):
        flattened("x", [[0] * 1_000_000], (1, 1))


INTEGERS = ["UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"]


@PROPERTY
@given(name=st.sampled_from(INTEGERS), data=st.data())
def test_integers_convert_exactly_when_in_range(name: str, data: st.DataObject) -> None:
    info = np.iinfo(BY_NAME[name].numpy)
    inside = data.draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=1))
    expected = np.array(inside, BY_NAME[name].numpy).tobytes()
    assert converted("x", inside, BY_NAME[name]) == expected
    outside = data.draw(st.integers(int(info.max) + 1) | st.integers(max_value=int(info.min) - 1))
    with pytest.raises(ServiceError, match=f"integers from {info.min} to {info.max}"):
        converted("x", [*inside, outside], BY_NAME[name])
    with pytest.raises(ServiceError):
        converted("x", [*inside, 0.5], BY_NAME[name])


@PROPERTY
@given(name=st.sampled_from(["FP16", "FP32", "FP64"]), values=st.lists(st.floats(width=16)))
def test_floats_convert_as_numpy_rounds_them(name: str, values: list[float]) -> None:
    dtype = BY_NAME[name].numpy
    assert converted("x", values, BY_NAME[name]) == np.array(values, dtype).astype(dtype).tobytes()


@PROPERTY
@given(values=st.lists(st.floats(-(2.0**127), 2.0**127, width=32), min_size=1))
def test_bf16_is_the_nearest_bfloat16(values: list[float]) -> None:
    bits = np.frombuffer(converted("x", values, BY_NAME["BF16"]), "<u2")
    decoded = (bits.astype("<u4") << 16).view("<f4")
    exact = np.array(values, np.float32)
    # Within half a BF16 step (8 bits of mantissa) of the value sent.
    step = np.spacing(np.abs(exact)) * 2**16
    assert np.all(np.abs(decoded.astype(np.float64) - exact) <= step / 2 + 1e-45)


def test_bool_and_bytes_take_their_json_types() -> None:
    assert converted("x", [True, False], BY_NAME["BOOL"]) == b"\x01\x00"
    with pytest.raises(ServiceError, match="true or false"):
        converted("x", [1, 0], BY_NAME["BOOL"])
    assert converted("x", ["ab", ""], BY_NAME["BYTES"]) == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"
    with pytest.raises(ServiceError, match="must be strings"):
        converted("x", ["ab", 1], BY_NAME["BYTES"])
    with pytest.raises(ServiceError, match="numbers"):
        converted("x", [[1.0, 2.0], [3.0]], BY_NAME["FP32"])  # deeper than the shape, unevenly
    # Integers on both sides of 2**63 (numpy makes them floats): converted exactly.
    both = [0, 2**63, 2**64 - 1]
    assert converted("x", both, BY_NAME["UINT64"]) == np.array(both, np.uint64).tobytes()
    for wrong in ([1, None], [1, "2"], [2**63, None], [1, [2]]):
        with pytest.raises(ServiceError, match="integers from"):
            converted("x", wrong, BY_NAME["INT64"])


def test_triton_status_mapping() -> None:
    assert [
        http_status(code)
        for code in (
            grpc.StatusCode.INTERNAL,
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.UNIMPLEMENTED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
    ] == [500, 404, 503, 501, 429, 400, 400]


def test_only_a_restricted_category_is_403() -> None:
    """Both are UNAUTHENTICATED on gRPC: a restricted category's refusal is Triton's 403, a
    caller refused for want of a certificate (--sequence-callers certified) Triton's 400."""
    restricted = Restricted("admin-key", "this request's tensors name shared-memory regions")
    uncertified = ServiceError(grpc.StatusCode.UNAUTHENTICATED, "needs a client certificate")
    assert restricted.code is uncertified.code is grpc.StatusCode.UNAUTHENTICATED
    assert (error_status(restricted), error_status(uncertified)) == (403, 400)
    assert restricted.message.startswith("This API is restricted, expecting header 'admin-key'")


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        (None, None),
        ("", None),
        ("identity", None),
        ("gzip", "gzip"),
        ("deflate", "deflate"),
        ("gzip, deflate", "gzip"),
        ("gzip;q=0.5, deflate", "deflate"),
        ("deflate;q=0.2, gzip;q=0.1", "deflate"),
        ("gzip;q=0, deflate;q=0", None),
        ("br, *;q=0.3", "gzip"),
        ("*;q=0.3, gzip;q=0", "deflate"),
        ("GZIP ; q=1", "gzip"),
        ("gzip;q=nonsense", None),
    ],
)
def test_the_response_encoding_follows_accept_encoding_q_values(
    accept: str | None, chosen: str | None
) -> None:
    assert preferred(accept) == chosen


def test_a_character_split_across_stream_responses_comes_whole() -> None:
    """A token may end inside a UTF-8 character: its bytes come whole with the next event."""
    decoder = TextDecoder()
    texts = []
    for piece, final in ((b"caf\xc3", False), (b"\xa9!", False), (b"\xe2\x82", True)):
        tensor = OutputTensor("text_delta", BY_NAME["BYTES"], (1,), serialize_bytes([piece]))
        texts.append(decoder.event("m", "1", (tensor,), final)["text_delta"])
    assert texts == ["caf", "\u00e9!", "\ufffd"]  # a character cut short at the end: U+FFFD


@PROPERTY
@given(name=st.sampled_from(INTEGERS), data=st.data())
def test_integers_parsed_from_a_body_are_refused_out_of_range(
    name: str, data: st.DataObject
) -> None:
    """Past 64 bits the parser reads an integer as a float: still refused, never wrapped."""
    info = np.iinfo(BY_NAME[name].numpy)
    outside = data.draw(
        st.integers(int(info.max) + 1, 1 << 80) | st.integers(-(1 << 80), int(info.min) - 1)
    )
    (value,) = parsed(f"[{outside}]".encode())
    with pytest.raises(ServiceError):
        converted("x", [value], BY_NAME[name])


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_a_body_with_a_number_json_does_not_have_is_refused(literal: bytes) -> None:
    """As Triton's parser: NaN and infinities are not JSON."""
    with pytest.raises(ServiceError, match="not valid JSON"):
        parsed(b'{"data": [' + literal + b"]}")


_NUMERIC = [d for d in BY_NAME.values() if d.name not in ("BYTES", "BF16")]


@PROPERTY
@given(
    datatype=st.sampled_from(_NUMERIC),
    raw=st.binary(min_size=0, max_size=512),
)
def test_an_output_as_json_reads_back_as_the_same_values(datatype: Any, raw: bytes) -> None:
    """Any bytes as an output of any numeric datatype, written by `dumps` from the array
    itself: every value reads back as the same value of that datatype (a float as the same
    bits, -0.0 included), NaN and the infinities as null (JSON has no words for them)."""
    width = np.dtype(datatype.numpy).itemsize
    raw = raw[: len(raw) - len(raw) % width]
    values = np.frombuffer(raw, datatype.numpy)
    if datatype.name == "BOOL":
        values = values.astype(bool)
        raw = values.tobytes()
    tensor = OutputTensor("y", datatype, (len(values),), raw)
    read = json.loads(dumps({"outputs": [output_json(tensor, False)]}))["outputs"][0]["data"]
    assert len(read) == len(values)
    for wrote, back in zip(values.tolist(), read, strict=True):
        if isinstance(wrote, float) and not math.isfinite(wrote):
            assert back is None
        elif isinstance(wrote, float):
            assert (
                np.array(back, datatype.numpy).tobytes()
                == np.array(wrote, datatype.numpy).tobytes()
            )
        else:
            assert back == wrote


def test_a_bf16_output_as_json_is_its_float32_values() -> None:
    halves = np.array([0x3F80, 0xC000, 0x0000, 0x7F80], "<u2")  # 1.0, -2.0, 0.0, inf
    tensor = OutputTensor("y", BY_NAME["BF16"], (4,), halves.tobytes())
    assert json.loads(dumps(output_json(tensor, False)))["data"] == [1.0, -2.0, 0.0, None]
