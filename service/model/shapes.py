"""Shape buckets: the few input shapes a model's engine sees.

oneDNN builds kernels per input shape and caches a few shapes; a dynamic batcher forms a new
batch size almost every time, so unpadded batches keep rebuilding kernels (several times slower
than a fixed shape). Padding every batch to a small set of batch sizes, and where the config
asks every variable non-batch dimension to a small set of lengths, keeps the engine on shapes it
has built (and warmed up) before. Padded rows and positions never reach a response.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protos.inference import model_config_pb2 as mc
from service.model.files import PYTHON_BACKEND
from service.model.parameters import ParameterError, integer, string_parameters


@dataclass(frozen=True)
class ShapeBuckets:
    batch: tuple[int, ...] = ()  # ascending; empty: batches run at the size they were formed
    sequence: tuple[int, ...] = ()  # ascending; empty: variable dimensions are not padded
    pad_value: float = 0.0  # what padded positions of variable dimensions hold
    # Per input, the axes (of the request's tensor) the config declares variable, other than
    # the batch dimension: the ones sequence buckets pad.
    variable: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def batch_rows(self, rows: int) -> int:
        """The bucket a batch of `rows` runs at (itself beyond the largest bucket)."""
        return next((b for b in self.batch if b >= rows), rows)

    def length(self, size: int) -> int:
        """The bucket a variable dimension of `size` is padded to (itself beyond the largest)."""
        return next((s for s in self.sequence if s >= size), size)

    def padded_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """`shape` with the input's variable dimensions padded to their sequence bucket."""
        if not self.sequence:
            return shape
        axes = dict(self.variable).get(name, ())
        return tuple(self.length(d) if i in axes else d for i, d in enumerate(shape))

    def shape_count(self, variable_dims: int) -> int:
        """How many input shapes the buckets make for an input with that many variable
        non-batch dimensions: what the engine's shape cache must hold."""
        per_dim = len(self.sequence) if self.sequence else 1
        return max(len(self.batch), 1) * math.prod([per_dim] * variable_dims)


def shape_buckets(config: mc.ModelConfig) -> ShapeBuckets:
    """The buckets config.pbtxt asks for (parameters batch_buckets, sequence_buckets,
    sequence_pad_value); raises ParameterError naming a bad value.

    batch_buckets: unset means powers of two up to max_batch_size, the preferred batch sizes
    and max_batch_size itself; "none" turns padding off; else a comma-separated list (to which
    max_batch_size is added, so every batch has a bucket)."""
    if config.backend == PYTHON_BACKEND:
        return ShapeBuckets()  # a model.py gains nothing from padded, fixed shapes
    params = string_parameters(config)
    top = config.max_batch_size
    text = params.get("batch_buckets", "").strip().lower()
    batch: set[int] = set()
    if top > 0 and text != "none":
        if text:
            batch = set(_sizes("batch_buckets", text, top))
        else:
            batch = {2**i for i in range(int(math.log2(top)) + 1)}
            batch.update(s for s in config.dynamic_batching.preferred_batch_size if 0 < s <= top)
        batch.add(top)
    elif text and text != "none":
        raise ParameterError("parameter batch_buckets needs max_batch_size > 0")
    sequence = params.get("sequence_buckets", "").strip()
    pad = params.get("sequence_pad_value", "0").strip()
    try:
        pad_value = float(pad)
    except ValueError:
        raise ParameterError(
            f"parameter sequence_pad_value must be a number, not {pad!r}"
        ) from None
    first = 1 if top > 0 else 0  # the batch dimension is not in the config's dims
    variable = tuple(
        (t.name, tuple(i + first for i, d in enumerate(t.dims) if d < 0)) for t in config.input
    )
    if sequence and any(d < 0 for t in config.output for d in t.dims):
        raise ParameterError(
            "parameter sequence_buckets needs outputs without variable dimensions: padded "
            "positions could not be cut out of them"
        )
    return ShapeBuckets(
        tuple(sorted(batch)),
        tuple(sorted(set(_sizes("sequence_buckets", sequence, None)))) if sequence else (),
        pad_value,
        variable,
    )


def _sizes(name: str, text: str, largest: int | None) -> list[int]:
    sizes = [integer(name, part, 1) for part in text.split(",")]
    if largest is not None and max(sizes) > largest:
        raise ParameterError(f"parameter {name} holds {max(sizes)} > max_batch_size {largest}")
    return sizes
