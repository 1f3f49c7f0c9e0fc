"""The generation engine: one driver thread runs decode steps over the running batch, and
sequences join and leave it between steps (planner.py decides who joins).

Each loop: drop the sequences whose request was cancelled (their place is free at once),
pause those whose response sender is not writable (a slow reader holds its own sequence, not
the batch), plan the joiners, run one step (prefill each joiner and send its first token, then
decode every other sequence that is not paused) and send one response per new token. A
sequence that reaches max_tokens or a stop token leaves the batch in the same step and gets
its final response.

Responses are built by the model (a `Responder`), so the engine works with any
`triton_python_backend_utils`, paddlequic's or Triton's.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from service.backend.generation.decoder import PaddleDecoder
from service.backend.generation.planner import MODES, Mode, StepLimits, joiners
from service.backend.generation.sampling import next_token
from service.model.parameters import ParameterError, integer

log = logging.getLogger(__name__)

# Model parameters (config.pbtxt) of a model that runs this engine.
MAX_BATCH = "generation_max_batch"
TOKEN_BUDGET = "generation_token_budget"
MODE = "generation_mode"
DEFAULT_LIMITS = StepLimits(max_batch=32, token_budget=512)
# Triton's pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
FINAL = 1
# How often a loop with only paused sequences looks again whether their readers caught up
# (a sender has no callback for it).
PAUSED_POLL_S = 0.002


def limits_from(parameters: Mapping[str, str]) -> StepLimits:
    """The engine's limits from model parameters; ParameterError names a bad one."""
    default = DEFAULT_LIMITS
    max_batch = integer(MAX_BATCH, parameters.get(MAX_BATCH, str(default.max_batch)), 1)
    budget = integer(TOKEN_BUDGET, parameters.get(TOKEN_BUDGET, str(default.token_budget)), 1)
    if budget < max_batch:
        raise ParameterError(
            f"parameter {TOKEN_BUDGET} ({budget}) must be at least {MAX_BATCH} ({max_batch}): "
            "every sequence in a full batch decodes one token a step"
        )
    mode = parameters.get(MODE, default.mode).strip()
    if mode not in MODES:
        raise ParameterError(f"parameter {MODE} must be one of {', '.join(MODES)}, not {mode!r}")
    checked: Mode = "iteration" if mode == "iteration" else "request"
    return StepLimits(max_batch, budget, checked)


class Responder(Protocol):
    """Builds the model's responses (its own pb_utils objects)."""

    def token(self, token: int) -> Any: ...

    def final(self, reason: str) -> Any: ...

    def error(self, message: str) -> Any: ...


@dataclass(frozen=True)
class StepRecord:
    """What one step computed, for an observer (tests, benchmarks)."""

    decoded: int  # sequences that decoded one token
    prefilled: tuple[int, ...]  # prompt lengths of the sequences that joined
    held: int  # sequences in the batch after the step's joins, paused ones included

    @property
    def tokens(self) -> int:
        return self.decoded + sum(self.prefilled)


@dataclass(eq=False)
class Generation:
    """One sequence. `steps` counts the steps that computed a token for it."""

    request: Any
    sender: Any
    prompt: list[int]
    max_tokens: int
    temperature: float
    rng: np.random.Generator
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    steps: int = 0
    slot: int = -1  # its row of the engine's cache while it holds a place
    finish_reason: str | None = None

    def cancelled(self) -> bool:
        return bool(self.request.is_cancelled()) or bool(self.sender.is_cancelled())

    def writable(self) -> bool:
        """Whether a send would not block now (paddlequic's extension; Triton's sender
        never blocks)."""
        writable = getattr(self.sender, "writable", None)
        return True if writable is None else bool(writable())

    @property
    def position(self) -> int:
        """Where its last token goes in the cache when it is decoded."""
        return len(self.prompt) + len(self.tokens) - 1


class GenerationEngine:
    def __init__(
        self,
        decoder: PaddleDecoder,
        limits: StepLimits,
        responder: Responder,
        observer: Callable[[StepRecord], None] | None = None,
    ) -> None:
        self.decoder, self.limits, self.responder = decoder, limits, responder
        self.observer = observer
        self.steps = 0  # steps run so far
        self._cache = np.zeros(decoder.cache.batch(limits.max_batch), dtype=np.float32)
        self._running: list[Generation] = []  # _running[i].slot == i: its cache[:, :, i]
        self._waiting: deque[Generation] = deque()
        self._submitted: deque[Generation] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="generation", daemon=True)
        self._thread.start()

    def submit(
        self,
        request: Any,
        prompt: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_ids: Collection[int] = (),
    ) -> Generation:
        """Queue a sequence; ValueError (nothing queued) says why one cannot run. Its
        responses go to request.get_response_sender()."""
        context = self.decoder.cache.context
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
        if len(prompt) > self.limits.token_budget:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens, more than the token budget of a step "
                f"({TOKEN_BUDGET} = {self.limits.token_budget})"
            )
        if len(prompt) + max_tokens - 1 > context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"model's context of {context + 1} tokens"
            )
        if not temperature >= 0.0:  # also refuses nan
            raise ValueError(f"temperature must be >= 0, not {temperature}")
        generation = Generation(
            request,
            request.get_response_sender(),
            list(prompt),
            max_tokens,
            temperature,
            np.random.default_rng(seed),
            frozenset(stop_ids),
        )
        with self._wake:
            if self._closed:
                raise ValueError("the engine is shut down")
            self._submitted.append(generation)
            self._wake.notify()
        return generation

    def close(self) -> None:
        """Stop the driver; unfinished sequences get an error response."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._submitted and not self._busy():
                    self._wake.wait()
                if self._closed:
                    break
                self._waiting.extend(self._submitted)
                self._submitted.clear()
            self._drop_cancelled()
            decoding = [g for g in self._running if g.writable()]
            count = joiners(
                len(self._running),
                len(decoding),
                [len(g.prompt) for g in self._waiting],
                self.limits,
            )
            joining = [self._waiting.popleft() for _ in range(count)]
            if not decoding and not joining:
                with self._wake:  # only paused sequences: look again soon
                    self._wake.wait(PAUSED_POLL_S)
                continue
            try:
                self._step(decoding, joining)
            except Exception as exc:
                log.exception("generation step failed")
                for generation in decoding + joining:
                    # Not ended in the step before it failed (a joiner not prefilled yet has
                    # no place and no token).
                    if generation.slot >= 0 or not generation.steps:
                        self._fail(generation, f"generation step failed: {exc}")
        for generation in [*self._running, *self._waiting, *self._submitted]:
            self._fail(generation, "the model is shutting down")

    def _busy(self) -> bool:
        return bool(self._running or self._waiting)

    def _step(self, decoding: list[Generation], joining: list[Generation]) -> None:
        """Prefill each joiner and send its first token at once, then decode the others: a
        new request's first token waits neither for the batch's decode nor for the joiners
        after it (its time to first token is its prefill and those before it)."""
        held = len(self._running) + len(joining)
        for generation in joining:
            logits, kv = self.decoder.prefill(generation.prompt)
            generation.slot = len(self._running)
            self._running.append(generation)
            # Zero beyond the prompt: the row is then exactly what it is when run alone.
            own = self._cache[:, :, generation.slot]
            length = len(generation.prompt)
            own[:, :, :, :length] = kv
            own[:, :, :, length:] = 0.0
            # Its first token now, not after the other joiners' prefills (it is the last row
            # of the batch, so if it ends at once its release moves no other sequence).
            self._emit(generation, next_token(logits, generation.temperature, generation.rng))
        produced: list[tuple[Generation, int]] = []
        if decoding:
            slots = [g.slot for g in decoding]  # after the joiners that ended left
            contiguous = slots == list(range(len(slots)))
            cache = self._cache[:, :, : len(slots)] if contiguous else self._cache[:, :, slots]
            positions = np.array([g.position for g in decoding], dtype=np.int64)
            logits, kv = self.decoder.decode(
                np.array([g.tokens[-1] for g in decoding], dtype=np.int64), positions, cache
            )
            # One scatter for the batch: advanced indices first, so the target is kv's shape.
            self._cache[:, :, slots, :, positions] = kv
            greedy = np.argmax(logits, axis=1)  # one call for the batch, not one per row
            for row, g in enumerate(decoding):
                sampled = g.temperature > 0.0
                token = next_token(logits[row], g.temperature, g.rng) if sampled else greedy[row]
                produced.append((g, int(token)))
        self.steps += 1
        if self.observer is not None:
            self.observer(StepRecord(len(decoding), tuple(len(g.prompt) for g in joining), held))
        for generation, token in produced:
            self._emit(generation, token)

    def _emit(self, generation: Generation, token: int) -> None:
        generation.steps += 1
        generation.tokens.append(token)
        if token in generation.stop_ids:
            self._finish(generation, "stop")
            return
        try:
            generation.sender.send(self.responder.token(token))
        except Exception as exc:
            log.warning("a response could not be sent, the sequence ends: %s", exc)
            self._release(generation)
            return
        if len(generation.tokens) == generation.max_tokens:
            self._finish(generation, "length")

    def _finish(self, generation: Generation, reason: str) -> None:
        generation.finish_reason = reason
        self._release(generation)
        self._send(generation, self.responder.final(reason))

    def _drop_cancelled(self) -> None:
        for generation in [g for g in self._running if g.cancelled()]:
            log.info(
                "request %r cancelled after %d step(s); it leaves the batch",
                generation.request.request_id(),
                generation.steps,
            )
            self._release(generation)
            self._send(generation, None)
        for generation in [g for g in self._waiting if g.cancelled()]:
            self._waiting.remove(generation)
            self._send(generation, None)

    def _release(self, generation: Generation) -> None:
        """Free its place in the batch: the last sequence moves into its cache row."""
        if generation.slot < 0:
            return
        slot, last = generation.slot, self._running.pop()
        if last is not generation:
            self._cache[:, :, slot] = self._cache[:, :, last.slot]
            last.slot = slot
            self._running[slot] = last
        generation.slot = -1

    def _fail(self, generation: Generation, message: str) -> None:
        self._release(generation)
        self._send(generation, self.responder.error(message))

    @staticmethod
    def _send(generation: Generation, response: Any) -> None:
        """A final send (it needs no credit: it never waits for a slow reader); a sender that
        refuses it (closed) is logged."""
        try:
            generation.sender.send(response, flags=FINAL)
        except Exception as exc:
            log.warning("a final response could not be sent: %s", exc)
