"""Triton's `reshape` on an input or output: clients send and receive `dims`, the model sees
`reshape.shape` (the batch dimension, if any, in front of both). Served for Paddle models with
fixed shapes of equal element counts; the worker reshapes at the predictor's edge, so warm-up,
batching and every caller get the same view."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from protos.inference import model_config_pb2 as mc
from service.model.files import PYTHON_BACKEND

Tensor = mc.ModelInput | mc.ModelOutput


def model_dims(entry: Tensor) -> Sequence[int]:
    """The shape the model itself has for `entry` (without the batch dimension)."""
    return entry.reshape.shape if entry.HasField("reshape") else entry.dims


def refusal(config: mc.ModelConfig) -> str | None:
    """Why a reshape in `config` cannot be served, or None."""
    tensors: list[Tensor] = [*config.input, *config.output]
    for entry in tensors:
        if not entry.HasField("reshape"):
            continue
        dims, shape = list(entry.dims), list(entry.reshape.shape)
        if config.backend == PYTHON_BACKEND:
            return f"{entry.name!r}: reshape is served for Paddle models only"
        if any(d < 0 for d in dims + shape):
            return f"{entry.name!r}: reshape needs fixed dims and shape (no -1): {dims} -> {shape}"
        if math.prod(dims) != math.prod(shape):
            return (
                f"{entry.name!r}: reshape {shape} holds {math.prod(shape)} elements but dims "
                f"{dims} hold {math.prod(dims)}"
            )
    return None


def reshaped(array: np.ndarray[Any, Any], have: Sequence[int], want: Sequence[int]) -> Any:
    """`array`, whose trailing dimensions are `have`, with `want` in their place."""
    lead = array.ndim - len(have)
    return array.reshape(array.shape[:lead] + tuple(want))
