"""The numpy client's arrays <-> tensors, named by oip's one datatype table: every numpy dtype a
request can carry, in either byte order, and the dtypes it refuses."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from clients.tensors import build_request, parse_response, random_array
from oip.datatypes import DATATYPES
from protos.inference import grpc_service_pb2 as pb

FIXED = [d for d in DATATYPES if d.name not in ("BF16", "BYTES")]
PROPERTY = settings(derandomize=True, max_examples=60, deadline=None)


def echoed(request: pb.ModelInferRequest) -> dict[str, np.ndarray[Any, Any]]:
    """The request's inputs as a server would send them back as outputs."""
    response = pb.ModelInferResponse(raw_output_contents=request.raw_input_contents)
    for tensor in request.inputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
    return parse_response(response)


@st.composite
def arrays(draw: st.DrawFn) -> tuple[str, np.ndarray[Any, Any]]:
    datatype = draw(st.sampled_from(FIXED))
    big_endian = draw(st.booleans())
    dtype = datatype.numpy.newbyteorder(">" if big_endian else "<")
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    return datatype.name, draw(hnp.arrays(dtype, shape))


@PROPERTY
@given(arrays())
def test_arrays_of_either_byte_order_round_trip_with_their_datatype(
    named: tuple[str, np.ndarray[Any, Any]],
) -> None:
    name, array = named
    request = build_request("m", {"x": array})
    assert request.inputs[0].datatype == name
    assert list(request.inputs[0].shape) == list(array.shape)
    back = echoed(request)["x"]
    assert back.shape == array.shape
    np.testing.assert_array_equal(back, array)


@pytest.mark.parametrize(
    "array",
    [np.array([[b"ab", b""]], dtype=object), np.array([["ab", "c"]], dtype=object)],
    ids=["bytes-objects", "str-objects"],
)
def test_object_arrays_are_bytes_tensors(array: np.ndarray[Any, Any]) -> None:
    request = build_request("m", {"x": array})
    assert request.inputs[0].datatype == "BYTES"
    expected = [v.encode() if isinstance(v, str) else v for v in array.flat]
    assert list(echoed(request)["x"].flat) == expected


def test_numpy_bytes_arrays_are_bytes_tensors() -> None:
    request = build_request("m", {"x": np.array([b"ab", b"c"])})
    assert request.inputs[0].datatype == "BYTES"
    assert list(echoed(request)["x"].flat) == [b"ab", b"c"]


@pytest.mark.parametrize("dtype", ["complex64", "<U3", "datetime64[s]", "V4"])
def test_dtypes_without_a_datatype_are_refused(dtype: str) -> None:
    with pytest.raises(ValueError, match="has no protocol datatype"):
        build_request("m", {"x": np.zeros(2, dtype)})


@pytest.mark.parametrize("datatype", [d.name for d in FIXED])
def test_random_arrays_are_sent_as_their_datatype(datatype: str) -> None:
    array = random_array(datatype, (2, 3), np.random.default_rng(0))
    assert build_request("m", {"x": array}).inputs[0].datatype == datatype


@pytest.mark.parametrize("datatype", ["BYTES", "BF16"])
def test_random_arrays_of_datatypes_numpy_cannot_carry_are_refused(datatype: str) -> None:
    with pytest.raises(ValueError, match=f"no random values for {datatype}"):
        random_array(datatype, (2,), np.random.default_rng(0))
