"""RequestValidator on protobuf requests, without a server.

Whatever a client sends, validate() must either return a job a worker can run as is (every
declared input exactly once, exactly prod(shape) * itemsize bytes each) or refuse it with
INVALID_ARGUMENT; anything else would reach Paddle, which crashes or silently computes garbage
on bad input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import text_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oip.datatypes import BY_CONFIG_TYPE, BY_NAME, DATATYPES, Datatype
from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.inference.errors import ServiceError
from service.inference.jobs import InferJob
from service.inference.validation import DEFAULT_ELEMENTS_PER_ROW, RequestValidator, element_limit

# Batched, with every kind of input: fixed and variable dims, typed and raw-only datatypes.
MIXED = text_format.Parse(
    """
    name: "mixed"
    max_batch_size: 8
    input [
      { name: "dense" data_type: TYPE_FP32 dims: [ 3 ] },
      { name: "ids" data_type: TYPE_INT64 dims: [ -1 ] },
      { name: "half" data_type: TYPE_FP16 dims: [ 2, -1 ] },
      { name: "mask" data_type: TYPE_BOOL dims: [ 1 ] },
      { name: "small" data_type: TYPE_INT8 dims: [ 2 ] }
    ]
    output [
      { name: "out0" data_type: TYPE_FP32 dims: [ 4 ] },
      { name: "out1" data_type: TYPE_FP32 dims: [ 1 ] }
    ]
    """,
    mc.ModelConfig(),
)
# Not batched: shapes are exactly the dims, and batch_size is 0.
UNBATCHED = text_format.Parse(
    """
    name: "unbatched"
    max_batch_size: 0
    input [
      { name: "x" data_type: TYPE_FP64 dims: [ 2, -1 ] },
      { name: "b" data_type: TYPE_BF16 dims: [ 4 ] },
      { name: "u" data_type: TYPE_UINT8 dims: [ -1 ] }
    ]
    output [ { name: "y" data_type: TYPE_FP64 dims: [ 2 ] } ]
    """,
    mc.ModelConfig(),
)
MLP = text_format.Parse(
    """
    name: "mlp"
    max_batch_size: 64
    input [ { name: "input" data_type: TYPE_FP32 dims: [ 256 ] } ]
    output [ { name: "fetch_name_0" data_type: TYPE_FP32 dims: [ 10 ] } ]
    """,
    mc.ModelConfig(),
)
# Every fixed-size datatype that typed contents can carry (BYTES: tests/unit/test_bytes_tensors.py).
TYPED = mc.ModelConfig(name="typed", max_batch_size=4)
for _dt in DATATYPES:
    if _dt.contents_field is not None and _dt.name != "BYTES":
        TYPED.input.add(name=_dt.name.lower(), data_type=_dt.config_type, dims=[-1])
TYPED.output.add(name="out", data_type=mc.TYPE_FP32, dims=[1])
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def itemsize(datatype: str) -> int:
    return BY_NAME[datatype].numpy.itemsize


def raw_request(
    model: str, tensors: Sequence[tuple[str, str, Sequence[int]]], **extra: Any
) -> pb.ModelInferRequest:
    """Raw contents of the right length (sequential byte values) for each (name, dt, shape)."""
    request = pb.ModelInferRequest(model_name=model, **extra)
    for name, datatype, shape in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        size = math.prod(shape) * itemsize(datatype) if all(d > 0 for d in shape) else 0
        request.raw_input_contents.append(bytes(i % 251 for i in range(size)))
    return request


def valid_mixed(batch: int = 2, **extra: Any) -> pb.ModelInferRequest:
    return raw_request(
        "mixed",
        [
            ("dense", "FP32", (batch, 3)),
            ("ids", "INT64", (batch, 5)),
            ("half", "FP16", (batch, 2, 7)),
            ("mask", "BOOL", (batch, 1)),
            ("small", "INT8", (batch, 2)),
        ],
        **extra,
    )


def refusal(config: mc.ModelConfig, request: pb.ModelInferRequest) -> str:
    """The message validate() refuses the request with; fails if it is accepted."""
    with pytest.raises(ServiceError) as info:
        RequestValidator(config).validate(request)
    assert info.value.code == INVALID, info.value
    return info.value.message


# Accepted requests.


def test_valid_raw_request_passes_bytes_through() -> None:
    request = valid_mixed(batch=3)
    job = RequestValidator(MIXED).validate(request)
    assert job.batch_size == 3
    assert job.outputs == ("out0", "out1")
    assert [(t.name, t.datatype.name, t.shape) for t in job.inputs] == [
        ("dense", "FP32", (3, 3)),
        ("ids", "INT64", (3, 5)),
        ("half", "FP16", (3, 2, 7)),
        ("mask", "BOOL", (3, 1)),
        ("small", "INT8", (3, 2)),
    ]
    assert [t.data for t in job.inputs] == list(request.raw_input_contents)


def test_inputs_may_come_in_any_order() -> None:
    request = raw_request("two", [("b", "FP32", (1, 2)), ("a", "FP32", (1, 1))])
    two = text_format.Parse(
        'name: "two" max_batch_size: 4 input [{ name: "a" data_type: TYPE_FP32 dims: [1] },'
        '{ name: "b" data_type: TYPE_FP32 dims: [2] }] output [{ name: "o" data_type: TYPE_FP32 }]',
        mc.ModelConfig(),
    )
    assert {t.name for t in RequestValidator(two).validate(request).inputs} == {"a", "b"}


def test_requested_outputs_keep_their_order() -> None:
    request = valid_mixed()
    for name in ("out1", "out0"):
        request.outputs.add(name=name)
    assert RequestValidator(MIXED).validate(request).outputs == ("out1", "out0")


def test_unbatched_model_takes_exact_shapes() -> None:
    request = raw_request(
        "unbatched", [("x", "FP64", (2, 9)), ("b", "BF16", (4,)), ("u", "UINT8", (1,))]
    )
    job = RequestValidator(UNBATCHED).validate(request)
    assert job.batch_size == 0
    assert [t.shape for t in job.inputs] == [(2, 9), (4,), (1,)]


@pytest.mark.parametrize(
    ("datatype", "field", "values"),
    [
        ("FP32", "fp32_contents", [0.5, -1.0, 3.25]),
        ("FP64", "fp64_contents", [0.1, 2.0, -3.0]),
        ("INT64", "int64_contents", [-(2**63), 0, 2**63 - 1]),
        ("INT32", "int_contents", [-(2**31), 7, 2**31 - 1]),
        ("INT8", "int_contents", [-128, 0, 127]),
        ("UINT8", "uint_contents", [0, 200, 255]),
        ("UINT64", "uint64_contents", [0, 1, 2**64 - 1]),
        ("BOOL", "bool_contents", [True, False, True]),
    ],
)
def test_typed_contents_become_little_endian_bytes(
    datatype: str, field: str, values: list[Any]
) -> None:
    config = mc.ModelConfig(name="t", max_batch_size=4)
    config.input.add(name="v", data_type=BY_NAME[datatype].config_type, dims=[3])
    request = pb.ModelInferRequest(model_name="t")
    tensor = request.inputs.add(name="v", datatype=datatype, shape=[1, 3])
    getattr(tensor.contents, field).extend(values)
    (job_input,) = RequestValidator(config).validate(request).inputs
    assert job_input.data == np.asarray(values, dtype=BY_NAME[datatype].numpy).tobytes()


# Refused requests: each rule, and a message that names what was wrong.


def test_missing_input() -> None:
    request = valid_mixed()
    del request.inputs[2]
    del request.raw_input_contents[2]
    assert "missing input(s) ['half']" in refusal(MIXED, request)


def test_no_inputs_at_all() -> None:
    message = refusal(MIXED, pb.ModelInferRequest(model_name="mixed"))
    assert "missing input(s) ['dense', 'half', 'ids', 'mask', 'small']" in message


def test_unknown_input() -> None:
    request = raw_request("mlp", [("input", "FP32", (1, 256)), ("extra", "FP32", (1, 256))])
    message = refusal(MLP, request)
    assert "no input 'extra'" in message
    assert "['input']" in message


def test_duplicate_input() -> None:
    request = raw_request("mlp", [("input", "FP32", (1, 256))] * 2)
    assert "'input' appears more than once" in refusal(MLP, request)


@pytest.mark.parametrize("datatype", ["FP64", "FP16", "INT32", "BF16", "fp32", ""])
def test_wrong_datatype(datatype: str) -> None:
    request = raw_request("mlp", [("input", "FP32", (1, 256))])
    request.inputs[0].datatype = datatype
    message = refusal(MLP, request)
    assert f"input 'input': expected datatype FP32, got {datatype or 'none'}" in message


def test_int32_ids_for_int64_input() -> None:
    request = valid_mixed()
    request.inputs[1].datatype = "INT32"
    request.raw_input_contents[1] = bytes(2 * 5 * 4)
    assert "input 'ids': expected datatype INT64, got INT32" in refusal(MIXED, request)


@pytest.mark.parametrize("shape", [(2, 1, 256), (256,), (), (1, 1, 1, 256)])
def test_wrong_rank(shape: tuple[int, ...]) -> None:
    message = refusal(MLP, raw_request("mlp", [("input", "FP32", shape)]))
    assert "input 'input': expected rank 2 (shape [-1, 256])" in message


def test_unbatched_rank_has_no_batch_dimension() -> None:
    request = raw_request(
        "unbatched", [("x", "FP64", (1, 2, 3)), ("b", "BF16", (4,)), ("u", "UINT8", (1,))]
    )
    assert "input 'x': expected rank 2 (shape [2, -1])" in refusal(UNBATCHED, request)


def test_wrong_fixed_dim() -> None:
    message = refusal(MLP, raw_request("mlp", [("input", "FP32", (2, 255))]))
    assert "input 'input': dimension 1 must be 256" in message


@pytest.mark.parametrize("shape", [(0, 256), (-1, 256), (2, 0), (2, -256), (-(2**63), 256)])
def test_empty_or_negative_dims(shape: tuple[int, ...]) -> None:
    message = refusal(MLP, raw_request("mlp", [("input", "FP32", shape)]))
    assert f"input 'input': every dimension must be >= 1, got {list(shape)}" in message


def test_batch_over_max_batch_size() -> None:
    message = refusal(MLP, raw_request("mlp", [("input", "FP32", (65, 256))]))
    assert "input 'input': batch size 65 exceeds max_batch_size 64" in message


@pytest.mark.parametrize("delta", [-1024, -1, 1, 4])
def test_raw_byte_length(delta: int) -> None:
    request = raw_request("mlp", [("input", "FP32", (1, 256))])
    request.raw_input_contents[0] = bytes(1024 + delta)
    message = refusal(MLP, request)
    assert "input 'input': shape [1, 256] of FP32 needs 1024 bytes" in message
    assert f"got {1024 + delta}" in message


def test_huge_shape_is_refused_without_allocating() -> None:
    """A shape whose byte size overflows int64 is only arithmetic, never an allocation."""
    request = raw_request("mlp", [("input", "FP32", (1, 256))])
    del request.inputs[0].shape[:]
    request.inputs[0].shape.extend([1, 2**62])
    ids = text_format.Parse(
        'name: "ids" max_batch_size: 4 input [{ name: "ids" data_type: TYPE_INT64 dims: [-1] }]',
        mc.ModelConfig(),
    )
    request.inputs[0].name, request.inputs[0].datatype = "ids", "INT64"
    message = refusal(ids, request)
    assert f"has {2**62} elements, more than max_input_elements {4 * 2**20}" in message


def test_variable_dims_are_bounded_by_default_fixed_ones_by_their_shape() -> None:
    assert element_limit(MIXED, (-1,)) == 8 * DEFAULT_ELEMENTS_PER_ROW
    assert element_limit(MIXED, (3,)) is None
    assert element_limit(UNBATCHED, (2, -1)) == DEFAULT_ELEMENTS_PER_ROW


def test_max_input_elements_from_the_config() -> None:
    config = text_format.Parse(
        'name: "ids" max_batch_size: 4 input [{ name: "ids" data_type: TYPE_INT64 dims: [-1] }]'
        ' parameters { key: "max_input_elements" value: { string_value: "10" } }',
        mc.ModelConfig(),
    )
    RequestValidator(config).validate(raw_request("ids", [("ids", "INT64", (2, 5))]))
    message = refusal(config, raw_request("ids", [("ids", "INT64", (2, 6))]))
    assert message == (
        "input 'ids': shape [2, 6] has 12 elements, more than max_input_elements 10 of model 'ids'"
    )


@pytest.mark.parametrize("count", [0, 2])
def test_raw_count_differs_from_inputs(count: int) -> None:
    request = raw_request("mlp", [("input", "FP32", (1, 256))])
    del request.raw_input_contents[:]
    request.raw_input_contents.extend([bytes(1024)] * count)
    message = refusal(MLP, request)
    if count:
        assert "2 raw_input_contents for 1 inputs" in message
    else:  # no raw at all means typed contents, which are missing
        assert "needs 256 values in contents.fp32_contents, got 0" in message


def test_both_raw_and_typed() -> None:
    request = raw_request("mlp", [("input", "FP32", (1, 256))])
    request.inputs[0].contents.fp32_contents.extend([0.0] * 256)
    assert refusal(MLP, request).startswith(
        "contents field must not be specified when using raw_input_contents for 'input' for "
        "model 'mlp'"
    )


@pytest.mark.parametrize("count", [0, 255, 257])
def test_typed_count(count: int) -> None:
    request = pb.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, 256])
    tensor.contents.fp32_contents.extend([1.0] * count)
    message = refusal(MLP, request)
    assert (
        f"input 'input': shape [1, 256] needs 256 values in contents.fp32_contents, got {count}"
        in message
    )


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_fp16_and_bf16_must_be_raw(datatype: str) -> None:
    """They have no typed contents field in the protocol."""
    config = mc.ModelConfig(name="half", max_batch_size=4)
    config.input.add(name="h", data_type=BY_NAME[datatype].config_type, dims=[2])
    request = pb.ModelInferRequest(model_name="half")
    tensor = request.inputs.add(name="h", datatype=datatype, shape=[1, 2])
    tensor.contents.fp32_contents.extend([0.5, 1.5])
    message = refusal(config, request)
    assert f"input 'h': {datatype} has no typed contents field" in message
    assert "raw_input_contents" in message


@pytest.mark.parametrize("value", [128, -129, 2**31 - 1])
def test_typed_value_out_of_range(value: int) -> None:
    request = valid_mixed(batch=1)
    del request.raw_input_contents[:]
    for tensor in request.inputs:
        field = BY_NAME[tensor.datatype].contents_field
        if field is not None:
            getattr(tensor.contents, field).extend([1] * math.prod(tensor.shape))
    small = request.inputs[4]
    small.contents.int_contents[0] = value
    # FP16 has no typed field, so drop it from the model to reach the INT8 check.
    config = mc.ModelConfig()
    config.CopyFrom(MIXED)
    del config.input[2]
    del request.inputs[2]
    assert "input 'small': a value does not fit INT8" in refusal(config, request)


def test_unknown_output() -> None:
    request = valid_mixed()
    request.outputs.add(name="nope")
    message = refusal(MIXED, request)
    assert "has no output 'nope'" in message
    assert "['out0', 'out1']" in message


def test_duplicate_output() -> None:
    request = valid_mixed()
    request.outputs.add(name="out0")
    request.outputs.add(name="out0")
    assert "output 'out0' is requested more than once" in refusal(MIXED, request)


def test_inputs_disagree_on_batch_size() -> None:
    request = valid_mixed(batch=2)
    request.inputs[3].shape[0] = 3
    request.raw_input_contents[3] = bytes(3)
    assert "inputs disagree on the batch size: [2, 3]" in refusal(MIXED, request)


# Properties over random requests.

ODD_DATATYPES = [*(d.name for d in DATATYPES), "", "fp32", "STRING", "BYTES"]
_INT_RANGES = {
    "int_contents": (-(2**31), 2**31 - 1),
    "int64_contents": (-(2**63), 2**63 - 1),
    "uint_contents": (0, 2**32 - 1),
    "uint64_contents": (0, 2**64 - 1),
}
_FIELDS = ["bool_contents", "bytes_contents", "fp32_contents", "fp64_contents", *_INT_RANGES]
# What a fuzzed request may get wrong; each example breaks none, one or a few of these.
RULES = (
    "names",
    "datatype",
    "dims",
    "batch",
    "size",
    "raw_count",
    "raw_and_typed",
    "field",
    "values",
    "outputs",
)
ODD_DIMS = st.one_of(st.integers(-3, 9), st.integers(2**31, 2**62))


def _in_range(datatype: Datatype) -> st.SearchStrategy[Any]:
    """Values a typed contents field may carry for this datatype."""
    if datatype.contents_field == "bytes_contents":
        return st.binary(max_size=8)
    kind = datatype.numpy.kind
    if kind == "b":
        return st.booleans()
    if kind in "iu":
        info = np.iinfo(datatype.numpy)
        return st.integers(int(info.min), int(info.max))
    if datatype.numpy.itemsize == 4:  # FP32 (FP16 and BF16 have no typed contents)
        return st.floats(width=32, allow_nan=False)
    return st.floats(allow_nan=False)


def _field_values(field: str) -> st.SearchStrategy[Any]:
    """Anything the protobuf field itself can hold, which may not fit the tensor's dtype."""
    if field == "bool_contents":
        return st.booleans()
    if field == "bytes_contents":
        return st.binary(max_size=8)
    if field in _INT_RANGES:
        low, high = _INT_RANGES[field]
        return st.one_of(st.integers(max(low, -300), 300), st.integers(low, high))
    return st.floats(width=32 if field == "fp32_contents" else 64)


@st.composite
def fuzzed_requests(draw: st.DrawFn) -> tuple[mc.ModelConfig, pb.ModelInferRequest]:
    """Valid requests with none, one or a few rules broken, so both outcomes are common."""
    config = draw(st.sampled_from([MIXED, UNBATCHED, TYPED]))
    broken = draw(
        st.one_of(st.just(frozenset()), st.frozensets(st.sampled_from(RULES), max_size=3))
    )

    def breaks(rule: str) -> bool:
        return rule in broken and draw(st.booleans())

    declared = {i.name: i for i in config.input}
    names = draw(st.permutations(sorted(declared)))
    if "names" in broken:
        names = draw(st.lists(st.sampled_from([*declared, "extra"]), max_size=len(declared) + 1))
    raw_only = any(BY_CONFIG_TYPE[i.data_type].contents_field is None for i in config.input)
    use_raw = (raw_only and "field" not in broken) or draw(st.booleans())
    batch = draw(st.integers(1, config.max_batch_size)) if config.max_batch_size else None
    request = pb.ModelInferRequest(model_name=config.name)
    for name in names:
        entry = declared.get(name)
        datatype = BY_CONFIG_TYPE[entry.data_type].name if entry is not None else "FP32"
        if breaks("datatype"):
            datatype = draw(st.sampled_from(ODD_DATATYPES))
        dims = [draw(st.integers(1, 3)) if d == -1 else d for d in entry.dims] if entry else [3]
        if breaks("dims"):
            if len(dims) > 0 and draw(st.booleans()):
                dims[draw(st.integers(0, len(dims) - 1))] = draw(ODD_DIMS)
            else:
                dims = draw(st.lists(ODD_DIMS, max_size=4))
        if batch is not None:
            this_batch = draw(st.one_of(st.integers(1, config.max_batch_size + 1), ODD_DIMS))
            dims.insert(0, this_batch if breaks("batch") else batch)
        shape = dims
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        known = BY_NAME.get(datatype)
        count = math.prod(shape) if all(0 < d <= 4096 for d in shape) else 0
        count = count if count <= 4096 else 0
        if use_raw:
            nbytes = count * (known.numpy.itemsize if known else 4)
            if breaks("size"):
                nbytes = draw(st.integers(0, nbytes + 9))
            request.raw_input_contents.append(bytes(nbytes))
            if breaks("raw_and_typed"):
                tensor.contents.fp32_contents.append(0.0)
            continue
        count = count if count <= 64 else 0  # keeps examples within Hypothesis's buffer
        field = known.contents_field if known else None
        if field is None or breaks("field"):
            field = draw(st.sampled_from(_FIELDS))
        if breaks("size"):
            count = draw(st.integers(0, count + 3))
        natural = known is not None and field == known.contents_field and not breaks("values")
        element = _in_range(known) if natural and known else _field_values(field)
        getattr(tensor.contents, field).extend(
            draw(st.lists(element, min_size=count, max_size=count))
        )
    if use_raw and "raw_count" in broken:
        if len(request.raw_input_contents) > 0 and draw(st.booleans()):
            del request.raw_input_contents[-1]
        else:
            request.raw_input_contents.append(b"")
    outputs = [o.name for o in config.output]
    if "outputs" in broken:
        requested = draw(st.lists(st.sampled_from([*outputs, "nope"]), max_size=3))
    else:
        requested = draw(st.lists(st.sampled_from(outputs), unique=True))
    for name in requested:
        request.outputs.add(name=name)
    return config, request


def assert_runnable(config: mc.ModelConfig, request: pb.ModelInferRequest, job: InferJob) -> None:
    """What a worker relies on: the declared inputs, well formed, nothing else."""
    declared = {i.name: i for i in config.input}
    names = [t.name for t in job.inputs]
    assert sorted(names) == sorted(declared)
    batched = config.max_batch_size > 0
    for tensor in job.inputs:
        entry = declared[tensor.name]
        assert tensor.datatype is BY_CONFIG_TYPE[entry.data_type]
        assert len(tensor.data) == math.prod(tensor.shape) * tensor.datatype.numpy.itemsize
        dims = tensor.shape[1:] if batched else tensor.shape
        assert len(dims) == len(entry.dims)
        assert all(d >= 1 for d in tensor.shape)
        assert all(want in (-1, got) for got, want in zip(dims, entry.dims, strict=True))
    if batched:
        assert {t.shape[0] for t in job.inputs} == {job.batch_size}
        assert 1 <= job.batch_size <= config.max_batch_size
    else:
        assert job.batch_size == 0
    requested = [o.name for o in request.outputs]
    assert list(job.outputs) == (requested or [o.name for o in config.output])
    assert len(set(job.outputs)) == len(job.outputs)
    if request.raw_input_contents:
        sent = dict(zip([t.name for t in request.inputs], request.raw_input_contents, strict=True))
        assert all(t.data == sent[t.name] for t in job.inputs)


def property_settings(examples: int) -> settings:
    """Reproducible runs: the same examples every time, and no wall-clock deadline."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


@property_settings(800)
@given(fuzzed_requests())
def test_any_request_is_runnable_or_invalid_argument(
    case: tuple[mc.ModelConfig, pb.ModelInferRequest],
) -> None:
    config, request = case
    try:
        job = RequestValidator(config).validate(request)
    except ServiceError as exc:
        assert exc.code == INVALID, exc
        assert exc.message
        return
    assert_runnable(config, request, job)


@st.composite
def valid_requests(draw: st.DrawFn) -> tuple[mc.ModelConfig, pb.ModelInferRequest, bool]:
    """Requests that follow every rule, in raw or typed form."""
    config = draw(st.sampled_from([MIXED, UNBATCHED, MLP, TYPED]))
    use_raw = draw(st.booleans()) or any(
        BY_CONFIG_TYPE[i.data_type].contents_field is None for i in config.input
    )
    batch = [draw(st.integers(1, config.max_batch_size))] if config.max_batch_size else []
    request = pb.ModelInferRequest(model_name=config.name)
    for entry in draw(st.permutations(list(config.input))):
        datatype = BY_CONFIG_TYPE[entry.data_type]
        shape = batch + [draw(st.integers(1, 5)) if d == -1 else d for d in entry.dims]
        tensor = request.inputs.add(name=entry.name, datatype=datatype.name, shape=shape)
        count = math.prod(shape)
        if use_raw:
            size = count * datatype.numpy.itemsize
            request.raw_input_contents.append(draw(st.binary(min_size=size, max_size=size)))
        else:
            assert datatype.contents_field is not None
            # Drawing every value would overrun Hypothesis's buffer for large tensors.
            head = draw(st.lists(_in_range(datatype), min_size=1, max_size=min(count, 16)))
            values = (head * count)[:count]
            getattr(tensor.contents, datatype.contents_field).extend(values)
    outputs = [o.name for o in config.output]
    for name in draw(st.lists(st.sampled_from(outputs), unique=True)):
        request.outputs.add(name=name)
    return config, request, use_raw


@property_settings(400)
@given(valid_requests())
def test_every_valid_request_is_accepted_unchanged(
    case: tuple[mc.ModelConfig, pb.ModelInferRequest, bool],
) -> None:
    config, request, use_raw = case
    job = RequestValidator(config).validate(request)
    assert_runnable(config, request, job)
    for tensor, sent in zip(job.inputs, request.inputs, strict=True):
        assert tensor.shape == tuple(sent.shape)
        if not use_raw:
            field = tensor.datatype.contents_field
            assert field is not None
            values = getattr(sent.contents, field)
            assert tensor.data == np.asarray(values, dtype=tensor.datatype.numpy).tobytes()


PROMPT = text_format.Parse(
    """
    name: "prompt"
    max_batch_size: 0
    input [
      { name: "text" data_type: TYPE_STRING dims: [ 1 ] },
      { name: "ids" data_type: TYPE_INT32 dims: [ -1 ] }
    ]
    output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
    parameters { key: "max_input_bytes" value: { string_value: "64" } }
    """,
    mc.ModelConfig(),
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(size=st.integers(0, 200), raw=st.booleans())
def test_an_input_over_max_input_bytes_is_never_handed_to_the_model(size: int, raw: bool) -> None:
    """Serialized as raw contents count it (a BYTES element with its 4-byte length), raw or
    typed, text or numbers. Typed text is measured once serialized, after the checks that
    cost nothing (typed numbers' size is their count)."""
    request = pb.ModelInferRequest(model_name="prompt")
    text = request.inputs.add(name="text", datatype="BYTES", shape=[1])
    ids = request.inputs.add(name="ids", datatype="INT32", shape=[max(1, size // 4)])
    if raw:
        request.raw_input_contents.extend(
            [len(b"t" * size).to_bytes(4, "little") + b"t" * size, bytes(4 * max(1, size // 4))]
        )
    else:
        text.contents.bytes_contents.append(b"t" * size)
        ids.contents.int_contents.extend([0] * max(1, size // 4))
    text_bytes, ids_bytes = 4 + size, 4 * max(1, size // 4)
    if max(text_bytes, ids_bytes) <= 64:
        RequestValidator(PROMPT).validate(request)
        return
    text_first = text_bytes > 64 and (raw or ids_bytes <= 64)
    name, held = ("text", text_bytes) if text_first else ("ids", ids_bytes)
    assert refusal(PROMPT, request) == (
        f"input '{name}' has {held} bytes, more than max_input_bytes 64 of model 'prompt'"
    )
