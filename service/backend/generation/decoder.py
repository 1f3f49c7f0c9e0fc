"""The decoder LM's two Paddle programs, exported side by side (DIR/prefill, DIR/decode; see
scripts/export_models.py, DecoderLM), each in a PaddleModel.

- prefill: token_ids [1, n] -> logits [1, vocab], keys/values [1, layers, 2, heads, n, dim]
- decode: token_ids [b, 1], positions [b], keys_L and values_L [b, heads, context, dim] per
  layer L -> logits [b, vocab], the new token's keys/values [b, layers, 2, heads, 1, dim]

Decode's shapes depend on the batch size only (the cache has a fixed capacity, unused slots
masked) and a prompt is prefilled alone, so a sequence's logits do not depend on what else is
in the batch: with oneDNN, rows of a batch are computed independently of each other (bitwise
equal alone and in a batch of 16 with AVX-512 and AVX2 kernels, measured; not a promise of
oneDNN's for every CPU).
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
    layers: int
    heads: int
    context: int  # positions a sequence may reach: prompt plus generated tokens
    head_dim: int

    def batch(self, sequences: int) -> tuple[int, ...]:
        """The cache of a batch: [layers, 2 (keys, values), sequences, heads, context,
        head_dim], so each layer's keys (or values) of the first b sequences are one
        contiguous block, fed to the program without a copy of our own."""
        return (self.layers, 2, sequences, self.heads, self.context, self.head_dim)


class PaddleDecoder:
    def __init__(
        self, directory: Path, parameters: Mapping[str, str], max_batch: int, name: str
    ) -> None:
        """`parameters`: the model's (engine options such as cpu_math_threads apply to both
        programs); oneDNN's kernel cache is sized for decode's batch sizes."""
        self.prefill_model = _model(directory / "prefill", {**parameters, "onednn": "false"}, name)
        decode_parameters = {"onednn_cache_capacity": str(max_batch), **parameters}
        self.decode_model = _model(directory / "decode", decode_parameters, name)
        names = {t.name: t.shape for t in self.decode_model.inputs}
        if "keys_0" not in names:
            raise RuntimeError(
                f"{directory / 'decode'} takes inputs {sorted(names)}, not the cache of each "
                "layer (keys_0, values_0, ...): it was exported by an older "
                "scripts/export_models.py; run `make models`"
            )
        layers = sum(name.startswith("keys_") for name in names)
        _, heads, context, head_dim = names["keys_0"]
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
        """One step of b sequences with their cache (CacheShape.batch(b)): logits [b, vocab],
        new keys/values [b, layers, 2, heads, head_dim]."""
        inputs = {"token_ids": token_ids.reshape(-1, 1), "positions": positions}
        for layer in range(self.cache.layers):
            inputs[f"keys_{layer}"] = np.ascontiguousarray(cache[layer, 0])
            inputs[f"values_{layer}"] = np.ascontiguousarray(cache[layer, 1])
        result, _ = self.decode_model.run(inputs, self._decode_outputs)
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
