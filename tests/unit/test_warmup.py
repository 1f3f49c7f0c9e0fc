"""What a version runs before READY: every shape bucket, then config.pbtxt's model_warmup
samples; each is a job the model's own validator accepts."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from protos.inference import model_config_pb2 as mc
from service.inference.validation import RequestValidator
from service.lifecycle.warmup import WarmUpError, warm_ups
from service.model.shapes import shape_buckets

MLP = """
name: "mlp"
max_batch_size: 8
input [ { name: "input", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 10 ] } ]
"""
TEXT = """
name: "text"
max_batch_size: 4
input [ { name: "ids", data_type: TYPE_INT64, dims: [ -1 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 4 ] } ]
parameters { key: "sequence_buckets" value: { string_value: "8,32" } }
"""
SAMPLE = """
model_warmup [ {
  name: "noise" batch_size: 3 count: 2
  inputs { key: "input" value: { data_type: TYPE_FP32, dims: [ 16 ], random_data: true } }
} ]
"""


def parse(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def shapes_of(config: mc.ModelConfig) -> list[tuple[str, list[int], int]]:
    validator = RequestValidator(config)
    plan = []
    for warm_up in warm_ups(config, shape_buckets(config)):
        job = validator.check(warm_up.job.inputs, warm_up.job.outputs).finish()
        assert job == warm_up.job
        plan.append((warm_up.name, list(job.inputs[0].shape), warm_up.count))
    return plan


def test_every_batch_bucket_is_warmed_with_zeros() -> None:
    config = parse(MLP)
    assert shapes_of(config) == [
        ("bucket 1", [1, 16], 1),
        ("bucket 2", [2, 16], 1),
        ("bucket 4", [4, 16], 1),
        ("bucket 8", [8, 16], 1),
    ]
    (first, *_) = warm_ups(config, shape_buckets(config))
    assert first.job.inputs[0].data == bytes(16 * 4)


def test_sequence_buckets_are_warmed_at_every_length() -> None:
    assert [shape for _, shape, _ in shapes_of(parse(TEXT))] == [
        [1, 8],
        [1, 32],
        [2, 8],
        [2, 32],
        [4, 8],
        [4, 32],
    ]


def test_a_model_without_batching_warms_once_without_a_batch_dimension() -> None:
    config = parse(MLP.replace("max_batch_size: 8", "max_batch_size: 0").replace("16", "2, 16"))
    assert shapes_of(config) == [("bucket unbatched", [2, 16], 1)]


def test_model_warmup_samples_run_after_the_buckets_with_seeded_random_data() -> None:
    config = parse(MLP + SAMPLE)
    assert shapes_of(config)[-1] == ("noise", [3, 16], 2)
    first, second = (warm_ups(config, shape_buckets(config))[-1] for _ in range(2))
    data = np.frombuffer(first.job.inputs[0].data, np.float32)
    assert data.std() > 0.5 and first.job == second.job


@pytest.mark.parametrize(
    ("old", "new", "reason"),
    [
        ("batch_size: 3", "batch_size: 9", "batch_size must be 1..8"),
        ("count: 2", "count: 5000", "count must be <= 1000"),
        ('key: "input"', 'key: "other"', "inputs must be exactly \\['input'\\]"),
        ("random_data: true", 'input_data_file: "x.bin"', "needs zero_data or random_data"),
        ("data_type: TYPE_FP32, dims", "data_type: TYPE_INT32, dims", "is TYPE_FP32, not"),
        ("dims: [ 16 ], random", "dims: [ 15 ], random", "dims \\[15\\] do not fit \\[16\\]"),
    ],
)
def test_samples_that_do_not_fit_the_model_are_refused(old: str, new: str, reason: str) -> None:
    config = parse(MLP + SAMPLE.replace(old, new))
    with pytest.raises(WarmUpError, match=reason):
        warm_ups(config, shape_buckets(config))
