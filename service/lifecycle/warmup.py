"""The inferences a version runs before it reports READY: one per shape bucket, so the engine
has built its kernels for every shape it will see before the first caller waits on it (Paddle
models only), then the samples of config.pbtxt's `model_warmup` (Triton's: zero or random
data, `count` times)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from oip.bytes_tensor import serialize_bytes
from oip.datatypes import BY_CONFIG_TYPE, config_type_name
from protos.inference import model_config_pb2 as mc
from service.inference.jobs import InferJob, InputTensor
from service.model.files import PYTHON_BACKEND
from service.model.shapes import ShapeBuckets

MAX_WARMUP_COUNT = 1000  # per sample: a typo must not keep a version loading for hours


class WarmUpError(ValueError):
    pass


@dataclass(frozen=True)
class WarmUp:
    name: str
    job: InferJob
    count: int = 1
    bucket: bool = False  # one of the shape buckets (else a model_warmup sample)


def warm_ups(config: mc.ModelConfig, shapes: ShapeBuckets) -> list[WarmUp]:
    """Every bucket (smallest first), then the configured samples; raises WarmUpError naming
    a sample that does not fit the model. A Python model runs its samples only, as Triton runs
    it: its execute() may need real inputs or call models still loading, and it has no
    kernels to build per shape."""
    plan = [] if config.backend == PYTHON_BACKEND else _buckets(config, shapes)
    plan.extend(_sample(config, sample) for sample in config.model_warmup)
    return plan


def _buckets(config: mc.ModelConfig, shapes: ShapeBuckets) -> list[WarmUp]:
    batches: Sequence[int | None] = shapes.batch or ([1] if config.max_batch_size > 0 else [None])
    variable = any(d < 0 for t in config.input for d in t.dims)
    lengths = shapes.sequence if variable and shapes.sequence else (1,)
    plan = []
    for rows, length in itertools.product(batches, lengths):
        dims = {t.name: [length if d < 0 else d for d in t.dims] for t in config.input}
        label = f"bucket {rows or 'unbatched'}" + (f" x {length}" if variable else "")
        plan.append(WarmUp(label, _job(config, rows, dims, zero=True), bucket=True))
    return plan


def _sample(config: mc.ModelConfig, sample: mc.ModelWarmup) -> WarmUp:
    where = f"model_warmup {sample.name!r}"
    if config.max_batch_size > 0 and not 1 <= sample.batch_size <= config.max_batch_size:
        raise WarmUpError(f"{where}: batch_size must be 1..{config.max_batch_size}")
    if sample.count > MAX_WARMUP_COUNT:
        raise WarmUpError(f"{where}: count must be <= {MAX_WARMUP_COUNT}")
    declared = {t.name: t for t in config.input}
    if set(sample.inputs) != set(declared):
        raise WarmUpError(f"{where}: inputs must be exactly {sorted(declared)}")
    dims: dict[str, list[int]] = {}
    zero = True
    for name, given in sorted(sample.inputs.items()):
        tensor = declared[name]
        kind = given.WhichOneof("input_data_type")
        if kind == "input_data_file" or kind is None:
            raise WarmUpError(f"{where}: input {name!r} needs zero_data or random_data")
        zero = zero and kind == "zero_data"
        if given.data_type != tensor.data_type:
            raise WarmUpError(
                f"{where}: input {name!r} is {config_type_name(tensor.data_type)}, "
                f"not {config_type_name(given.data_type)}"
            )
        fits = len(given.dims) == len(tensor.dims) and all(
            g > 0 and d in (g, -1) for g, d in zip(given.dims, tensor.dims, strict=True)
        )
        if not fits:
            raise WarmUpError(
                f"{where}: input {name!r} dims {list(given.dims)} do not fit {list(tensor.dims)}"
            )
        dims[name] = list(given.dims)
    rows = sample.batch_size if config.max_batch_size > 0 else None
    return WarmUp(sample.name, _job(config, rows, dims, zero), max(sample.count, 1))


def _job(
    config: mc.ModelConfig, rows: int | None, dims: dict[str, list[int]], zero: bool
) -> InferJob:
    """Zeros, or seeded random data: floats from a normal distribution, integers 0 or 1 (so
    ids stay in range of any embedding); BYTES elements are empty either way."""
    random = np.random.default_rng(0)
    inputs = []
    for tensor in config.input:
        datatype = BY_CONFIG_TYPE[tensor.data_type]
        shape = ([] if rows is None else [rows]) + dims[tensor.name]
        if datatype.name == "BYTES":
            data = serialize_bytes([b""] * math.prod(shape))
        elif zero:
            data = bytes(math.prod(shape) * datatype.numpy.itemsize)
        elif datatype.numpy.kind == "f" and datatype.name != "BF16":
            data = random.standard_normal(shape).astype(datatype.numpy).tobytes()
        else:
            data = random.integers(0, 2, shape).astype(datatype.numpy).tobytes()
        inputs.append(InputTensor(tensor.name, datatype, tuple(shape), data))
    outputs = tuple(o.name for o in config.output)
    return InferJob(tuple(inputs), outputs, rows or 0)
