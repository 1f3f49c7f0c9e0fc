"""BYTES tensors: tritonclient's length-prefixed encoding, validated at the edge and split per
request after a batch, without a server."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from oip.bytes_tensor import deserialize_bytes, serialize_bytes, to_numpy_bytes
from oip.datatypes import BY_NAME
from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.batching.assemble import BatchOutput, plan
from service.inference.errors import ServiceError
from service.inference.validation import RequestValidator
from service.lifecycle.warmup import warm_ups
from service.model.shapes import ShapeBuckets
from tests.unit.test_batching import written

TEXT = mc.ModelConfig(name="text", max_batch_size=4)
TEXT.input.add(name="text", data_type=mc.TYPE_STRING, dims=[2])
TEXT.output.add(name="label", data_type=mc.TYPE_STRING, dims=[1])


def request_with(raw: bytes | None = None, typed: list[bytes] | None = None, rows: int = 1):  # type: ignore[no-untyped-def]
    request = pb.ModelInferRequest(model_name="text")
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[rows, 2])
    if raw is not None:
        request.raw_input_contents.append(raw)
    if typed is not None:
        tensor.contents.bytes_contents.extend(typed)
    return request


def refusal(request: pb.ModelInferRequest) -> str:
    with pytest.raises(ServiceError) as caught:
        RequestValidator(TEXT).validate(request)
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    return caught.value.message


def test_encoding_round_trips_including_empty_and_binary_elements() -> None:
    values = [b"", b"hello", "héllo".encode(), bytes(range(256))]
    data = serialize_bytes(values)
    assert data[:4] == b"\0\0\0\0" and data[4:8] == (5).to_bytes(4, "little")
    assert deserialize_bytes(data, len(values)) == values
    array = to_numpy_bytes(data, (2, 2))
    assert array.shape == (2, 2) and array[1, 1] == bytes(range(256))


def test_raw_and_typed_contents_become_the_same_job() -> None:
    values = [b"good movie", b"bad"]
    raw = RequestValidator(TEXT).validate(request_with(raw=serialize_bytes(values)))
    typed = RequestValidator(TEXT).validate(request_with(typed=values))
    assert raw.inputs[0].data == typed.inputs[0].data == serialize_bytes(values)
    assert raw.batch_size == 1


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (serialize_bytes([b"one"]), "needs 2 BYTES elements, raw_input_contents holds 1"),
        (
            serialize_bytes([b"a", b"b", b"c"]),
            "needs 2 BYTES elements, raw_input_contents holds more (5 bytes follow element 2)",
        ),
        (serialize_bytes([b"a"]) + b"\x09\0\0\0abc", "claims 9 bytes; only 3 remain"),
        (serialize_bytes([b"a"]) + b"\x01\0", "is cut short"),
        (b"\xff\xff\xff\xff", "claims 4294967295 bytes"),
    ],
)
def test_malformed_raw_contents_are_refused(raw: bytes, expected: str) -> None:
    assert expected in refusal(request_with(raw=raw))


def test_typed_element_count_must_match_the_shape() -> None:
    assert "needs 2 values in contents.bytes_contents, got 3" in refusal(
        request_with(typed=[b"a", b"b", b"c"])
    )


def test_each_requests_elements_are_written_in_order_and_split_back() -> None:
    validator = RequestValidator(TEXT)
    first = validator.validate(request_with(typed=[b"a", b"bb"]))
    second = validator.validate(request_with(typed=[b"ccc", b"", b"dd", b"e"], rows=2))
    batch = plan([first, second])
    assert batch.rows == 3
    assert deserialize_bytes(written(batch)[0], 6) == [b"a", b"bb", b"ccc", b"", b"dd", b"e"]
    labels = BatchOutput(
        "label", BY_NAME["BYTES"], (3, 1), serialize_bytes([b"pos", b"negative", b""])
    )
    parts = batch.split([labels])
    assert [deserialize_bytes(p[0].data, p[0].shape[0]) for p in parts] == [
        [b"pos"],
        [b"negative", b""],
    ]
    assert [p[0].shape for p in parts] == [(1, 1), (2, 1)]


def test_bytes_is_a_protocol_datatype_with_typed_contents() -> None:
    assert BY_NAME["BYTES"].contents_field == "bytes_contents"
    assert BY_NAME["BYTES"].config_type == mc.TYPE_STRING
    assert BY_NAME["BYTES"].numpy == np.dtype(object)


def test_the_numpy_client_sends_and_reads_bytes_tensors() -> None:
    text = np.array([["good", "bad"]], dtype=object)
    request = build_request("text", {"text": text})
    assert request.inputs[0].datatype == "BYTES"
    job = RequestValidator(TEXT).validate(request)
    assert deserialize_bytes(job.inputs[0].data, 2) == [b"good", b"bad"]
    response = pb.ModelInferResponse(model_name="text")
    response.outputs.add(name="label", datatype="BYTES", shape=[1, 1])
    response.raw_output_contents.append(serialize_bytes([b"positive"]))
    assert parse_response(response)["label"].tolist() == [[b"positive"]]


def test_padded_batches_get_empty_elements_that_never_reach_a_response() -> None:
    validator = RequestValidator(TEXT)
    first = validator.validate(request_with(typed=[b"a", b"bb"]))
    second = validator.validate(request_with(typed=[b"c", b"d", b"e", b"f"], rows=2))
    batch = plan([first, second], ShapeBuckets(batch=(4, 8)))
    assert batch.rows == 4 and batch.inputs[0].shape == (4, 2)
    elements = [b"a", b"bb", b"c", b"d", b"e", b"f", b"", b""]
    assert deserialize_bytes(written(batch)[0], len(elements)) == elements
    labels = BatchOutput(
        "label", BY_NAME["BYTES"], (4, 1), serialize_bytes([b"x", b"y", b"z", b"pad"])
    )
    parts = batch.split([labels])
    assert [deserialize_bytes(p[0].data, p[0].shape[0]) for p in parts] == [[b"x"], [b"y", b"z"]]


def test_warm_up_jobs_carry_valid_empty_elements() -> None:
    for warm_up in warm_ups(TEXT, ShapeBuckets(batch=(1, 4))):
        job = RequestValidator(TEXT).check(warm_up.job.inputs, warm_up.job.outputs).finish()
        assert job == warm_up.job
        assert set(deserialize_bytes(job.inputs[0].data, math.prod(job.inputs[0].shape))) == {b""}


@pytest.mark.parametrize("buckets", [ShapeBuckets(), ShapeBuckets(batch=(4,))])
def test_one_requests_bytes_output_comes_back_whole_or_without_its_padding(
    buckets: ShapeBuckets,
) -> None:
    """One request and no padding: the output is the request's as it is (nothing to split);
    padded to 4 rows, the padding rows' elements stay behind."""
    job = RequestValidator(TEXT).validate(request_with(typed=[b"a", b"b", b"c", b"d"], rows=2))
    batch = plan([job], buckets)
    elements = [b"x", b"yy", b"pad", b"pad"][: batch.rows]
    labels = BatchOutput("label", BY_NAME["BYTES"], (batch.rows, 1), serialize_bytes(elements))
    ((label,),) = batch.split([labels])
    assert label.shape == (2, 1)
    assert label.data == serialize_bytes([b"x", b"yy"])
