"""Triton's raw binary request: a body that is one input's bytes and nothing else
(`Inference-Header-Content-Length: 0`), for a model whose one input's name, datatype and shape
follow from its configuration and the body's length (Triton's `InferenceRequest::Normalize`).

The shape is the model's dims, a batch of one where the model batches; at most one dimension
may be variable (-1), and it becomes what the body's length gives, which must divide evenly. A
BYTES input must hold one element: the body is its bytes, sent on with their 4-byte length as
every BYTES tensor is. Every output comes back as binary data, as Triton answers."""

from __future__ import annotations

import math

from oip.bytes_tensor import serialize_bytes
from service.http.json_tensors import InferRequest
from service.inference.errors import invalid
from service.inference.jobs import InputTensor
from service.inference.validation import RequestValidator

RAW = "raw binary request (Inference-Header-Content-Length: 0)"
# What a raw binary request asks besides its input: every output, as binary data.
RAW_REQUEST = InferRequest(
    id="",
    inputs=(),
    outputs=(),
    class_counts={},
    priority=None,
    timeout_s=None,
    binary_outputs=True,
    binary={},
    sequence=None,
    output_regions={},
)


def raw_input(data: bytes, validator: RequestValidator) -> InputTensor:
    """The model's one input holding `data`, its shape deduced (INVALID_ARGUMENT where the
    model's inputs do not allow it); the validator then checks it as any other input."""
    if len(validator.inputs) != 1:
        raise invalid(
            f"a {RAW} needs a model with one input; model '{validator.model}' has "
            f"{len(validator.inputs)}: send the inputs described in JSON"
        )
    ((name, declared),) = validator.inputs.items()
    batch = (1,) if validator.max_batch_size > 0 else ()
    variable = [axis for axis, d in enumerate(declared.dims) if d == -1]
    if len(variable) > 1:
        raise invalid(
            f"the shape of input '{name}' of a {RAW} cannot be deduced: "
            f"{list(declared.dims)} has more than one variable dimension"
        )
    fixed = math.prod(d for d in declared.dims if d != -1)
    if declared.datatype.name == "BYTES":
        if variable or fixed != 1:
            raise invalid(
                f"input '{name}' of a {RAW} is BYTES: the model must declare shape [1], "
                f"not {list(declared.dims)}"
            )
        return InputTensor(
            name, declared.datatype, (*batch, *declared.dims), serialize_bytes([data])
        )
    dims = list(declared.dims)
    if variable:
        row = fixed * declared.datatype.numpy.itemsize
        if not row or len(data) % row:
            raise invalid(
                f"input '{name}' of a {RAW}: {len(data)} bytes are not a whole number of "
                f"{declared.datatype.name} elements of shape {list(declared.dims)} ({row} bytes "
                "per step of its variable dimension)"
            )
        dims[variable[0]] = len(data) // row
    return InputTensor(name, declared.datatype, (*batch, *dims), data)
