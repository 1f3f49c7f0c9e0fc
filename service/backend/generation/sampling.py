"""The next token from a sequence's logits: the largest (greedy, temperature 0) or drawn
from softmax(logits / temperature) with the sequence's own generator, so a seeded sequence
draws the same tokens whatever else is in the batch."""

from __future__ import annotations

from typing import Any

import numpy as np


def next_token(logits: np.ndarray[Any, Any], temperature: float, rng: np.random.Generator) -> int:
    if temperature <= 0.0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    weights = np.exp(scaled - scaled.max())
    return int(rng.choice(len(weights), p=weights / weights.sum()))
