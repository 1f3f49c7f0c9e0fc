"""The Paddle Inference config calls a model's engine options make, as data.

Kept apart from Paddle itself so every option, GPU ones included, is checked and unit-tested on
any machine: the CPU build cannot enable a GPU or TensorRT, but the calls it would make can be
compared. paddle_model.py applies them to a real `paddle.inference.Config`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.inference.tensors import TensorSpec
from service.model.parameters import EngineOptions
from service.model.shapes import ShapeBuckets

# paddle.inference.PrecisionType member names
PRECISION_TYPES = {"fp32": "Float32", "fp16": "Half", "bf16": "Bfloat16"}


class EngineOptionError(ValueError):
    """A combination of options this model, device or machine cannot run; the reason says why."""


@dataclass(frozen=True)
class Call:
    """One method call on paddle.inference.Config. Arguments named in `precision` are
    PrecisionType member names, resolved when applied."""

    method: str
    args: tuple[Any, ...] = ()
    precision_arg: int | None = None  # index of an argument that names a PrecisionType


def config_calls(
    options: EngineOptions,
    device: str,
    program_suffix: str,
    inputs: Sequence[TensorSpec],
    shapes: ShapeBuckets,
    bf16_supported: bool,
) -> list[Call]:
    """Raises EngineOptionError with the reason for an option this setup cannot honour."""
    calls = [Call("switch_ir_optim", (options.ir_optim,))]
    if options.memory_optim:
        if program_suffix == ".json":
            raise EngineOptionError(
                "memory_optim is not available for Paddle 3 (.json) programs; remove it or "
                "export the model in the legacy .pdmodel format"
            )
        calls.append(Call("enable_memory_optim"))
    if device == "gpu":
        return calls + _gpu_calls(options, inputs, shapes)
    if options.tensorrt:
        raise EngineOptionError("tensorrt needs a GPU instance; this instance runs on the CPU")
    if options.precision == "fp16":
        raise EngineOptionError("precision fp16 needs a GPU instance; on the CPU use bf16")
    calls.append(Call("disable_gpu"))
    calls.append(Call("set_cpu_math_library_num_threads", (options.cpu_math_threads,)))
    if not options.onednn:
        if options.precision == "bf16":
            raise EngineOptionError("precision bf16 runs through oneDNN on the CPU; set onednn")
        return [*calls, Call("disable_mkldnn")]
    calls.append(Call("enable_mkldnn"))
    capacity = options.onednn_cache_capacity
    if capacity is None and shapes.batch:
        variable = max((sum(d < 0 for d in t.shape[1:]) for t in inputs), default=0)
        capacity = shapes.shape_count(variable)
    if capacity is not None:
        calls.append(Call("set_mkldnn_cache_capacity", (capacity,)))
    if options.precision == "bf16":
        if not bf16_supported:
            raise EngineOptionError(
                "precision bf16 needs a CPU with AVX-512 BF16 or AMX (oneDNN's bfloat16 "
                "kernels); this CPU has neither, use fp32"
            )
        calls.append(Call("enable_mkldnn_bfloat16"))
    return calls


def _gpu_calls(
    options: EngineOptions, inputs: Sequence[TensorSpec], shapes: ShapeBuckets
) -> list[Call]:
    if not options.tensorrt:
        return [
            Call(
                "enable_use_gpu",
                (options.gpu_memory_mb, 0, PRECISION_TYPES[options.precision]),
                precision_arg=2,
            )
        ]
    low, high = trt_shapes(inputs, shapes)
    return [
        Call("enable_use_gpu", (options.gpu_memory_mb, 0)),
        Call(
            "enable_tensorrt_engine",
            (
                options.tensorrt_workspace_mb << 20,
                max(shapes.batch, default=1),
                options.tensorrt_min_subgraph_size,
                PRECISION_TYPES[options.precision],
                False,  # use_static: no engine files written next to the model
                False,  # use_calib_mode: no int8 calibration
            ),
            precision_arg=3,
        ),
        # Paddle's order: min, max, opt. The largest bucket is what a loaded server runs.
        Call("set_trt_dynamic_shape_info", (low, high, high)),
    ]


def trt_shapes(
    inputs: Sequence[TensorSpec], shapes: ShapeBuckets
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """TensorRT's smallest and largest shape per input, from the buckets: the batch dimension
    spans the batch buckets, variable dimensions the sequence buckets."""
    low: dict[str, list[int]] = {}
    high: dict[str, list[int]] = {}
    for tensor in inputs:
        if any(d < 0 for d in tensor.shape[1:]) and not shapes.sequence:
            raise EngineOptionError(
                f"tensorrt needs the range of input {tensor.name!r}'s variable dimensions; "
                "set the sequence_buckets parameter"
            )
        batched = bool(tensor.shape) and tensor.shape[0] < 0
        rest = tensor.shape[1:] if batched else tensor.shape
        head_low = [min(shapes.batch, default=1)] if batched else []
        head_high = [max(shapes.batch, default=1)] if batched else []
        low[tensor.name] = head_low + [shapes.sequence[0] if d < 0 else d for d in rest]
        high[tensor.name] = head_high + [shapes.sequence[-1] if d < 0 else d for d in rest]
    return low, high
