"""The limits checked on a ModelInferRequest's wire bytes before it is parsed: a request over
them is refused, one within them is not, and the scan's own work (tags read) is bounded by the
limits, never by the entries sent."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from protos.inference import grpc_service_pb2 as pb
from service.api.wire_limits import (
    MAX_FIELDS,
    MAX_ID_BYTES,
    MAX_PARAMETERS,
    MAX_RANK,
    MAX_TENSORS,
    request_problem,
)
from tests.unit.test_validation import property_settings

# Tags of a small request besides its repeated entries: model name, version, id, one input
# (name, datatype, shape), one output, one raw contents.
FEW = 16
KINDS = {
    "inputs": MAX_TENSORS,
    "requested outputs": MAX_TENSORS,
    "raw_input_contents": MAX_TENSORS,
    "parameters": MAX_PARAMETERS,
    "dimensions in an input's shape": MAX_RANK,
    "parameters of an input": MAX_PARAMETERS,
    "parameters of a requested output": MAX_PARAMETERS,
}


def request_with(kind: str, count: int) -> pb.ModelInferRequest:
    """A request with `count` entries of one kind, the others within their limits."""
    request = pb.ModelInferRequest(model_name="m", model_version="1", id="x")
    tensor = request.inputs.add(name="a", datatype="FP32", shape=[1, 2])
    output = request.outputs.add(name="y")
    request.raw_input_contents.append(bytes(8))
    if kind == "inputs":
        for _ in range(count - 1):
            request.inputs.add()
    elif kind == "requested outputs":
        for _ in range(count - 1):
            request.outputs.add()
    elif kind == "raw_input_contents":
        request.raw_input_contents.extend([b""] * (count - 1))
    elif kind == "parameters":
        for key in range(count):
            request.parameters[str(key)].bool_param = True
    elif kind == "dimensions in an input's shape":
        del tensor.shape[:]
        tensor.shape.extend([1 << (key % 40) for key in range(count)])  # 1 to 6-byte varints
    elif kind == "parameters of an input":
        for key in range(count):
            tensor.parameters[str(key)].bool_param = True
    else:
        for key in range(count):
            output.parameters[str(key)].bool_param = True
    return request


@property_settings(60)
@given(
    kind=st.sampled_from(sorted(KINDS)),
    offset=st.one_of(st.integers(-3, 3), st.integers(4, 4000)),
)
def test_a_request_is_refused_exactly_past_a_limit_and_the_scan_stops_there(
    kind: str, offset: int
) -> None:
    limit = KINDS[kind]
    count = max(1, limit + offset)
    problem, read = request_problem(request_with(kind, count).SerializeToString())
    if count > limit:
        assert problem == f"the request has more than {limit} {kind}"
    else:
        assert problem == ""
    # Every kind but the shape is one tag per entry; the scan reads one past the limit at
    # most, plus the other fields of a small request.
    assert read <= min(count, limit + 1) + FEW


@pytest.mark.parametrize("packed", [True, False])
def test_a_shape_counts_its_dimensions_packed_or_not(packed: bool) -> None:
    """Packed (one field, what protobuf writes) or one field per dimension (what parsers must
    also accept): the same rank limit."""
    for rank in (MAX_RANK, MAX_RANK + 1):
        dims = b"\x01" * rank
        shape = b"\x1a" + bytes([rank]) + dims if packed else b"\x18\x01" * rank
        tensor = b"\x0a\x01a" + shape  # name "a", then the shape
        data = b"\x2a" + bytes([len(tensor)]) + tensor if len(tensor) < 128 else b""
        if not data:  # a two-byte length
            data = b"\x2a" + bytes([len(tensor) & 0x7F | 0x80, len(tensor) >> 7]) + tensor
        assert len(pb.ModelInferRequest.FromString(data).inputs[0].shape) == rank
        problem, _ = request_problem(data)
        assert bool(problem) == (rank > MAX_RANK)


@property_settings(10)
@given(st.integers(MAX_FIELDS + 1, 20 * MAX_FIELDS))
def test_unknown_fields_cost_the_scan_no_more_than_its_field_budget(entries: int) -> None:
    """Fields no limit names (the parser keeps them as bytes) still count against the scan's
    budget of tags."""
    data = b"\x78\x00" * entries  # field 15, a varint 0
    problem, read = request_problem(data)
    assert problem == f"the request has more than {MAX_FIELDS} fields"
    assert read == MAX_FIELDS


def test_contents_are_skipped_not_read() -> None:
    """A large request within the limits: one tag per field, whatever its contents hold."""
    request = pb.ModelInferRequest(model_name="m")
    for index in range(4):
        request.inputs.add(name=f"i{index}", datatype="FP32", shape=[4, 1 << 18])
        request.raw_input_contents.append(bytes(4 << 20))
    request.inputs[0].contents.bytes_contents.extend([b""] * 100_000)
    problem, read = request_problem(request.SerializeToString())
    assert problem == ""
    assert read == 1 + 4 * (1 + 3) + 1 + 4


@pytest.mark.parametrize("cut", [1, 2, 3, 7])
def test_malformed_wire_is_left_to_the_parser(cut: int) -> None:
    data = request_with("inputs", 3).SerializeToString()[:-cut]
    assert request_problem(data)[0] == ""
    with pytest.raises(DecodeError):
        pb.ModelInferRequest.FromString(data)


@property_settings(60)
@given(size=st.one_of(st.integers(MAX_ID_BYTES - 3, MAX_ID_BYTES + 3), st.integers(0, 1 << 16)))
def test_an_id_is_refused_exactly_past_its_limit(size: int) -> None:
    request = request_with("inputs", 1)
    request.id = "é" * (size // 2) + "x" * (size % 2)  # bytes, not characters, count
    problem, _ = request_problem(request.SerializeToString())
    if size > MAX_ID_BYTES:
        assert problem == f"the request's id has {size} bytes, more than {MAX_ID_BYTES}"
    else:
        assert problem == ""
