"""Triton's raw binary request (service/http/raw_binary.py): the one input's shape follows
from the model's dims and the body's length, exactly where Triton deduces it, and the request
is then checked as any other."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oip.bytes_tensor import serialize_bytes
from oip.datatypes import BY_NAME
from protos.inference import model_config_pb2 as mc
from service.http.raw_binary import raw_input
from service.inference.errors import ServiceError
from service.inference.validation import RequestValidator

FIXED_TYPES = ("BOOL", "UINT8", "INT16", "INT32", "INT64", "FP16", "BF16", "FP32", "FP64")


def validator(
    datatype: str, dims: list[int], max_batch_size: int = 0, inputs: int = 1
) -> RequestValidator:
    config = mc.ModelConfig(name="m", max_batch_size=max_batch_size)
    for index in range(inputs):
        config.input.add(name=f"in{index}", data_type=BY_NAME[datatype].config_type, dims=dims)
    config.output.add(name="out", data_type=mc.TYPE_FP32, dims=[1])
    return RequestValidator(config)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    datatype=st.sampled_from(FIXED_TYPES),
    dims=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    variable=st.one_of(st.none(), st.integers(0, 2)),
    batching=st.booleans(),
    length=st.integers(0, 200),
)
def test_the_shape_is_deduced_from_the_body_length(
    datatype: str, dims: list[int], variable: int | None, batching: bool, length: int
) -> None:
    """Fixed dims: the model's shape (a batch of one where it batches), the byte count checked
    by the validator; one variable dimension: the body's length divided by the rest, refused
    where it does not divide or leaves it 0."""
    if variable is not None:
        dims[min(variable, len(dims) - 1)] = -1
    checker = validator(datatype, dims, 8 if batching else 0)
    size = BY_NAME[datatype].numpy.itemsize
    row = math.prod(d for d in dims if d != -1) * size
    fits = length % row == 0 and (length > 0 if -1 in dims else length == row)
    data = b"\1" * length
    if not fits:
        with pytest.raises(ServiceError):
            checker.check((raw_input(data, checker),), ()).finish()
        return
    tensor = raw_input(data, checker)
    expected = [length // row if d == -1 else d for d in dims]
    assert tensor.shape == ((1,) if batching else ()) + tuple(expected)
    assert (tensor.name, tensor.datatype.name, tensor.data) == ("in0", datatype, data)
    (checked,) = checker.check((tensor,), ()).finish().inputs
    assert checked.shape == tensor.shape


def test_bytes_is_one_element_with_its_length_prefixed() -> None:
    tensor = raw_input(b"caf\xc3\xa9", validator("BYTES", [1], 4))
    assert (tensor.shape, tensor.data) == ((1, 1), serialize_bytes([b"caf\xc3\xa9"]))
    assert raw_input(b"", validator("BYTES", [], 0)).data == serialize_bytes([b""])


@pytest.mark.parametrize(
    ("datatype", "dims", "inputs", "message"),
    [
        ("FP32", [4], 2, "needs a model with one input; model 'm' has 2"),
        ("FP32", [-1, -1], 1, "more than one variable dimension"),
        ("BYTES", [2], 1, "the model must declare shape [1], not [2]"),
        ("BYTES", [-1], 1, "the model must declare shape [1], not [-1]"),
    ],
)
def test_models_whose_input_cannot_be_deduced_are_refused(
    datatype: str, dims: list[int], inputs: int, message: str
) -> None:
    with pytest.raises(ServiceError, match=message.replace("[", r"\[").replace("]", r"\]")):
        raw_input(b"\0" * 16, validator(datatype, dims, 0, inputs))
