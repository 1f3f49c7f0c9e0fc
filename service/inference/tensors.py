"""What a model declares of one input or output, as its files and config say."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output as the model file declares it (batch dim included, -1 = any)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
