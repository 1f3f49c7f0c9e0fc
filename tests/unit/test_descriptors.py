"""Descriptors on the dispatch connection: what a front-end sends for a ModelInfer call it
validated (INFER), the parent's answer and its view of served versions (MODELS) survive the
round trip whatever they hold, and bytes that are not one are refused, never misread."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from oip.datatypes import BY_NAME
from service.frontends.descriptors import (
    DescribedAnswer,
    DescribedRequest,
    Refusal,
    View,
    ViewEntry,
    decode_answer,
    decode_infer,
    decode_refusal,
    decode_view,
    encode_answer,
    encode_infer,
    encode_refusal,
    encode_view,
)
from service.frontends.protocol import Open, ProtocolViolation, Status
from service.inference.jobs import InputTensor, OutputTensor
from tests.unit.test_frontend_protocol import frozen_clock

texts = st.text(max_size=40)
shapes = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=8).map(tuple)
datatypes = st.sampled_from(sorted(BY_NAME)).map(BY_NAME.__getitem__)
tensor_fields = st.tuples(texts, datatypes, shapes, st.binary(max_size=64))
opens = st.builds(
    Open,
    texts,
    st.sampled_from(["h2", "h3"]),
    texts,
    st.none() | st.floats(0, 1e6),
    st.lists(st.tuples(texts, texts | st.binary(max_size=16)), max_size=3).map(tuple),
)
requests = st.builds(
    DescribedRequest,
    st.integers(0, 2**64 - 1),
    texts,
    texts,
    texts,
    st.lists(tensor_fields.map(lambda f: InputTensor(*f)), max_size=4).map(tuple),
    st.lists(texts, max_size=4).map(tuple),
    st.none() | st.integers(0, 2**63 - 1),
    st.none() | st.floats(0, 1e9),
    st.lists(st.tuples(texts, st.integers(1, 2**63 - 1)), max_size=3).map(tuple),
)
answers = st.builds(
    DescribedAnswer,
    texts,
    texts,
    texts,
    st.lists(tensor_fields.map(lambda f: OutputTensor(*f)), max_size=4).map(tuple),
    st.booleans(),
)
refusals = st.builds(
    Refusal,
    st.integers(0, 2**64 - 1),
    texts,
    texts,
    texts,
    st.builds(Status, st.sampled_from(list(grpc.StatusCode)), st.text(max_size=200), st.just(())),
)
views = st.lists(
    st.builds(
        ViewEntry,
        texts,
        texts,
        st.integers(0, 2**64 - 1),
        st.binary(max_size=64),
        st.lists(
            st.tuples(texts, st.lists(st.binary(max_size=16), max_size=5).map(tuple)), max_size=3
        ).map(tuple),
    ),
    max_size=4,
)


@given(opens, requests)
def test_a_described_call_survives_the_round_trip(opened: Open, request: DescribedRequest) -> None:
    with frozen_clock(0.0):  # the deadline travels as a point in time: exact from 0
        assert decode_infer(encode_infer(opened, request)) == (opened, request)


@given(answers)
def test_a_described_answer_survives_the_round_trip(answer: DescribedAnswer) -> None:
    assert decode_answer(encode_answer(answer)) == answer


@given(views, st.lists(texts, max_size=4).map(tuple))
def test_a_view_survives_the_round_trip(
    entries: list[ViewEntry], generation: tuple[str, ...]
) -> None:
    view = View(tuple(entries), generation)
    assert decode_view(encode_view(view)) == view


@given(opens, refusals, st.integers(0, 2**64 - 1))
def test_a_refusal_survives_the_round_trip(opened: Open, refusal: Refusal, elapsed: int) -> None:
    with frozen_clock(0.0):
        decoded = decode_refusal(encode_refusal(opened, refusal, elapsed))
    assert decoded == (opened, refusal, elapsed)


@given(opens, requests, answers, refusals, st.data())
def test_a_truncated_descriptor_is_refused(
    opened: Open,
    request: DescribedRequest,
    answer: DescribedAnswer,
    refusal: Refusal,
    data: st.DataObject,
) -> None:
    for encoded, decode in (
        (encode_infer(opened, request), decode_infer),
        (encode_answer(answer), decode_answer),
        (encode_refusal(opened, refusal, 1), decode_refusal),
    ):
        cut = data.draw(st.integers(0, len(encoded) - 1))
        with pytest.raises(ProtocolViolation):
            decode(encoded[:cut])
        with pytest.raises(ProtocolViolation):
            decode(encoded + b"\0")


@given(st.binary(max_size=200))
def test_garbage_is_refused_or_read_as_a_descriptor(garbage: bytes) -> None:
    """Random bytes: a ProtocolViolation (the link closes), never another error."""
    for decode, kind in (
        (decode_infer, tuple),
        (decode_answer, DescribedAnswer),
        (decode_view, View),
        (decode_refusal, tuple),
    ):
        try:
            decoded = decode(garbage)
        except ProtocolViolation:
            continue
        assert isinstance(decoded, kind)


def test_an_unknown_datatype_is_refused() -> None:
    answer = DescribedAnswer(
        "m", "1", "", (OutputTensor("o", BY_NAME["FP32"], (1,), b"abcd"),), False
    )
    encoded = encode_answer(answer).replace(b"FP32", b"XP32")
    with pytest.raises(ProtocolViolation, match="unknown datatype"):
        decode_answer(encoded)


def test_a_rank_over_the_limit_is_refused() -> None:
    answer = DescribedAnswer(
        "m", "1", "", (OutputTensor("o", BY_NAME["FP32"], (1,), b"abcd"),), False
    )
    encoded = bytearray(encode_answer(answer))
    rank_at = encoded.index(b"FP32") + 4
    encoded[rank_at] = 65
    with pytest.raises(ProtocolViolation, match="rank 65"):
        decode_answer(bytes(encoded))


def test_a_classification_of_no_classes_is_refused() -> None:
    """k is at least 1 (the front-end's view refuses 0 before it describes a request)."""
    request = DescribedRequest(1, "m", "", "", (), ("out",), None, None, (("out", 0),))
    opened = Open("/inference.GRPCInferenceService/ModelInfer", "h2", "", None, ())
    with frozen_clock(0.0), pytest.raises(ProtocolViolation, match="0 classes"):
        decode_infer(encode_infer(opened, request))
