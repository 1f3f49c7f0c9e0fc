"""Which waiting sequences join the running batch at the next decode step: a pure decision
on explicit inputs, like BatchQueue.next_batch, so the policy is tested without a model.

A step costs one token per running sequence that decodes in it (a paused one holds its place
but costs nothing) and its prompt's length per sequence that joins (its prefill). Waiting
sequences join in arrival order, none overtaking another, so a long prompt is never starved by
shorter ones behind it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Mode = Literal["iteration", "request"]
MODES: tuple[Mode, ...] = ("iteration", "request")


@dataclass(frozen=True)
class StepLimits:
    max_batch: int  # sequences holding a place in the batch (running, paused or joining)
    token_budget: int  # tokens one step may compute: decodes plus the prompts of joiners
    # iteration: sequences join between any two steps; request: only into an empty batch
    # (a batch is formed and every sequence in it runs to its end: the baseline).
    mode: Mode = "iteration"


def joiners(held: int, decoding: int, waiting: Sequence[int], limits: StepLimits) -> int:
    """How many of `waiting` (prompt lengths, in arrival order) join now: a prefix of it.

    held: sequences in the batch; decoding: those of them that decode this step (the others
    are paused). A prompt longer than the token budget never fits: the engine refuses it when
    it is submitted, so an empty batch always admits its first waiting sequence."""
    if limits.mode == "request" and held:
        return 0
    places = limits.max_batch - held
    tokens = decoding
    count = 0
    for length in waiting:
        if count == places or tokens + length > limits.token_budget:
            break
        tokens += length
        count += 1
    return count
