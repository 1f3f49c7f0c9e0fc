"""Shape buckets: which shapes a model's batches are padded to, and that padded rows and
positions never reach a response. Pure logic plus the batcher with a stand-in worker pool."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from google.protobuf import text_format

from oip.datatypes import BY_NAME
from protos.inference import model_config_pb2 as mc
from service.batching.assemble import BatchOutput, plan
from service.batching.batcher import DynamicBatcher, policy_from_config
from service.batching.queue import BatchPolicy, bucket_of
from service.inference.jobs import InferJob, InputTensor
from service.model.parameters import ParameterError
from service.model.shapes import ShapeBuckets, shape_buckets
from tests.unit.test_batching import FP32, _Executor, job, until, written
from tests.virtual_time import VirtualTimePolicy

TOKENS = """
name: "text"
max_batch_size: 8
input [ { name: "ids", data_type: TYPE_INT64, dims: [ -1 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


@pytest.fixture(scope="module")
def event_loop_policy() -> asyncio.AbstractEventLoopPolicy:
    return VirtualTimePolicy()


def config(text: str, **parameters: str) -> mc.ModelConfig:
    for key, value in parameters.items():
        text += f'\nparameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
    return text_format.Parse(text, mc.ModelConfig())


def tokens(*lengths: int, value: int = 7) -> list[InferJob]:
    return [
        InferJob(
            (InputTensor("ids", BY_NAME["INT64"], (1, n), np.full((1, n), value).tobytes()),),
            ("y",),
            1,
        )
        for n in lengths
    ]


def test_default_batch_buckets_are_powers_of_two_preferred_sizes_and_the_maximum() -> None:
    assert shape_buckets(config("max_batch_size: 64")).batch == (1, 2, 4, 8, 16, 32, 64)
    text = "max_batch_size: 12 dynamic_batching { preferred_batch_size: [ 6 ] }"
    assert shape_buckets(config(text)).batch == (1, 2, 4, 6, 8, 12)
    assert shape_buckets(config("max_batch_size: 12", batch_buckets="none")).batch == ()
    assert shape_buckets(config("max_batch_size: 8", batch_buckets="5, 3")).batch == (3, 5, 8)
    assert shape_buckets(config("max_batch_size: 0")).batch == ()


@pytest.mark.parametrize(
    ("text", "parameters", "reason"),
    [
        ("max_batch_size: 8", {"batch_buckets": "4,x"}, "must be an integer, not 'x'"),
        ("max_batch_size: 8", {"batch_buckets": "0"}, "must be >= 1, not 0"),
        ("max_batch_size: 8", {"batch_buckets": "16"}, "16 > max_batch_size 8"),
        ("max_batch_size: 0", {"batch_buckets": "4"}, "needs max_batch_size > 0"),
        ("max_batch_size: 8", {"sequence_pad_value": "pad"}, "must be a number"),
        (TOKENS.replace("dims: [ 4 ]", "dims: [ -1 ]"), {"sequence_buckets": "8"}, "outputs"),
    ],
)
def test_bad_bucket_parameters_are_refused_with_the_reason(
    text: str, parameters: dict[str, str], reason: str
) -> None:
    with pytest.raises(ParameterError, match=reason):
        shape_buckets(config(text, **parameters))


def test_sequence_buckets_pad_only_the_declared_variable_dimensions() -> None:
    text = TOKENS.replace("dims: [ -1 ]", "dims: [ 3, -1 ]")
    shapes = shape_buckets(config(text, sequence_buckets="32,8,16"))
    assert shapes.sequence == (8, 16, 32) and shapes.variable == (("ids", (2,)),)
    assert shapes.padded_shape("ids", (5, 3, 9)) == (5, 3, 16)
    assert shapes.padded_shape("ids", (5, 3, 40)) == (5, 3, 40)  # beyond the largest: as is
    assert shapes.shape_count(1) == 4 * 3  # batch buckets 1, 2, 4, 8 times three lengths


def test_padded_rows_are_zeros_and_never_reach_a_response() -> None:
    shapes = ShapeBuckets(batch=(1, 2, 4, 8))
    batch = plan([job(1, fill=1), job(2, fill=2)], shapes)
    assert batch.rows == 4 and batch.inputs[0].shape == (4, 4)
    # The padding row is written as zeros over whatever the shared memory held before.
    buffer = bytearray(b"\xff" * batch.inputs[0].nbytes)
    batch.inputs[0].write(memoryview(buffer))
    rows = np.frombuffer(buffer, np.float32).reshape(4, 4)[:, 0]
    assert rows.tolist() == [1, 2, 2, 0]
    out = BatchOutput("y", FP32, (4, 1), rows.reshape(4, 1).tobytes())
    first, second = batch.split([out])
    assert first[0].shape == (1, 1) and np.frombuffer(first[0].data, np.float32).tolist() == [1]
    assert np.frombuffer(second[0].data, np.float32).tolist() == [2, 2]
    # One request alone is padded too, and gets only its own rows back.
    alone = plan([job(3, fill=5)], shapes)
    assert alone.rows == 4
    out = BatchOutput("y", FP32, (4, 1), np.arange(4, dtype=np.float32).tobytes())
    (only,) = alone.split([out])
    assert only[0].shape == (3, 1) and np.frombuffer(only[0].data, np.float32).tolist() == [0, 1, 2]


def test_different_lengths_share_a_batch_padded_with_the_pad_value() -> None:
    shapes = shape_buckets(config(TOKENS, sequence_buckets="8,16", sequence_pad_value="-1"))
    short, long, shorter = tokens(9, 13, 3)
    assert bucket_of(short, shapes) == bucket_of(long, shapes) != bucket_of(shorter, shapes)
    batch = plan([short, long], shapes)
    assert batch.inputs[0].shape == (2, 16) and batch.rows == 2
    ids = np.frombuffer(written(batch)[0], np.int64).reshape(2, 16)
    assert ids[0].tolist() == [7] * 9 + [-1] * 7
    assert ids[1].tolist() == [7] * 13 + [-1] * 3


def test_a_model_without_batching_pads_its_variable_dimensions() -> None:
    text = TOKENS.replace("max_batch_size: 8", "max_batch_size: 0").replace("[ -1 ]", "[ 1, -1 ]")
    shapes = shape_buckets(config(text, sequence_buckets="8"))
    (request,) = tokens(6)
    request = InferJob(request.inputs, request.outputs, 0)
    batch = plan([request], shapes)
    assert batch.rows == 0 and batch.inputs[0].shape == (1, 8)
    assert np.frombuffer(written(batch)[0], np.int64).tolist() == [7] * 6 + [0, 0]


async def test_the_batcher_runs_bucket_sizes_and_answers_each_request_its_rows() -> None:
    executor = _Executor()
    text = "max_batch_size: 8 dynamic_batching { }"
    policy = policy_from_config(config(text), 1)
    assert policy.shapes.batch == (1, 2, 4, 8)
    batcher = DynamicBatcher(policy, executor, lambda: 1)
    first = batcher.enqueue(job(fill=1), None)
    await until(lambda: len(executor.batches) == 1, "the first request reached the instance")
    rest = [batcher.enqueue(job(fill=i), None) for i in (2, 3, 4, 5, 6)]
    await until(lambda: batcher.queued == 5, "the rest queued")
    executor.release.set()
    answers = await asyncio.gather(first, *rest)
    assert [b.rows for b in executor.batches] == [1, 8]  # 5 requests padded to 8
    assert [np.frombuffer(a.outputs[0].data, np.float32).tolist() for a in answers] == [
        [4],
        [8],
        [12],
        [16],
        [20],
        [24],
    ]
    assert all(a.outputs[0].shape == (1, 1) for a in answers)
    await batcher.stop()


def test_policy_without_buckets_keeps_batches_as_formed() -> None:
    assert BatchPolicy(8).shapes == ShapeBuckets()
    assert plan([job(3)]).rows == 3
