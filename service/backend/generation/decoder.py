"""The decoder LM's two Paddle programs, exported side by side (DIR/prefill, DIR/decode; see
scripts/export_models.py, DecoderLM), each in a PaddleModel.

- prefill: token_ids [1, n] -> logits [1, vocab], keys/values [1, layers, 2, heads, n, dim]
- decode: token_ids [b, 1], positions [b], cache [b, layers, 2, heads, context, dim] ->
  logits [b, vocab], the new token's keys/values [b, layers, 2, heads, 1, dim]

Decode's shapes depend on the batch size only (the cache has a fixed capacity, unused slots
masked) and a prompt is prefilled alone, so a sequence's logits are the same bits whatever
else is in the batch: with oneDNN, rows of a batch are computed independently of each other.
The prefill program sees a new prompt length at almost every call, so it runs without oneDNN
(whose kernel cache would rebuild kernels per shape)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.backend.load import Load
from service.backend.paddle_model import PaddleModel
from service.model.shapes import ShapeBuckets

PROGRAM = "inference.json"
PARAMS = "inference.pdiparams"


@dataclass(frozen=True)
class CacheShape:
    """One sequence's key/value cache: [layers, 2, heads, context, head_dim]."""

    layers: int
    heads: int
    context: int  # positions a sequence may reach: prompt plus generated tokens
    head_dim: int

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.heads, self.context, self.head_dim)


class PaddleDecoder:
    def __init__(
        self, directory: Path, parameters: Mapping[str, str], max_batch: int, name: str
    ) -> None:
        """`parameters`: the model's (engine options such as cpu_math_threads apply to both
        programs); oneDNN's kernel cache is sized for decode's batch sizes."""
        self.prefill_model = _model(directory / "prefill", {**parameters, "onednn": "false"}, name)
        decode_parameters = {"onednn_cache_capacity": str(max_batch), **parameters}
        self.decode_model = _model(directory / "decode", decode_parameters, name)
        cache = next(t for t in self.decode_model.inputs if t.name == "cache")
        _, layers, _, heads, context, head_dim = cache.shape
        self.cache = CacheShape(layers, heads, context, head_dim)
        self._prefill_outputs = tuple(o.name for o in self.prefill_model.outputs)
        self._decode_outputs = tuple(o.name for o in self.decode_model.outputs)

    def prefill(self, token_ids: list[int]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """A prompt's logits for its next token [vocab] and its keys/values
        [layers, 2, heads, n, head_dim]."""
        result, _ = self.prefill_model.run(
            {"token_ids": np.array([token_ids], dtype=np.int64)}, self._prefill_outputs
        )
        logits, kv = (result[name] for name in self._prefill_outputs)
        return logits[0], kv[0]

    def decode(
        self,
        token_ids: np.ndarray[Any, Any],
        positions: np.ndarray[Any, Any],
        cache: np.ndarray[Any, Any],
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """One step of b sequences: logits [b, vocab], new keys/values
        [b, layers, 2, heads, head_dim]."""
        result, _ = self.decode_model.run(
            {"token_ids": token_ids.reshape(-1, 1), "positions": positions, "cache": cache},
            self._decode_outputs,
        )
        logits, kv = (result[name] for name in self._decode_outputs)
        return logits, kv[:, :, :, :, 0]


def _model(directory: Path, parameters: Mapping[str, str], name: str) -> PaddleModel:
    return PaddleModel(
        Load(
            f"{name}/{directory.name}",
            1,
            str(directory / PROGRAM),
            str(directory / PARAMS),
            dict(parameters),
            "cpu",
            ShapeBuckets(),
        )
    )
