"""The engine-only section of `make bench-generate`: the same three ways (one at a time,
request-level, iteration-level) driven in-process on the generation engine with the exported
LM, no server, so the scheduling effect is measured without the per-token serving cost (a
response through the front-end and the client for every token).

Closed-loop client threads each submit one request after another and wait for its final
response; tokens/s over the measurement and time to first token (submitted to the first token
handed to its sender)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from service.backend.generation.decoder import PaddleDecoder
from service.backend.generation.engine import FINAL, GenerationEngine
from service.backend.generation.planner import StepLimits
from service.backend.generation.tokenizer import CharTokenizer

WAIT_S = 300.0  # a ceiling for one request, never a measured time


class Sender:
    """One request and its response sender: counts tokens, notes the first one's time."""

    def __init__(self) -> None:
        self.tokens, self.first, self.error = 0, 0.0, ""
        self.start = time.perf_counter()
        self.done = threading.Event()

    def get_response_sender(self) -> Sender:
        return self

    def is_cancelled(self) -> bool:
        return False

    def send(self, response: Any = None, flags: int = 0) -> None:
        if response is not None and response[0] == "token":
            if self.tokens == 0:
                self.first = time.perf_counter() - self.start
            self.tokens += 1
        if response is not None and response[0] == "error":
            self.error = response[1]
        if flags & FINAL:
            self.done.set()


class Responses:
    """What the example's model builds, without pb_utils: the token's text."""

    def __init__(self, tokenizer: CharTokenizer) -> None:
        self.tokenizer = tokenizer

    def token(self, token: int) -> tuple[str, str]:
        return ("token", self.tokenizer.decode(token))

    def final(self, reason: str) -> tuple[str, str]:
        return ("final", reason)

    def error(self, message: str) -> tuple[str, str]:
        return ("error", message)


class EngineBench:
    def __init__(self, model_version: Any, prompt: str, max_batch: int) -> None:
        """`model_version`: the example's version directory (lm/, vocab.json)."""
        self.tokenizer = CharTokenizer(model_version / "vocab.json")
        self.decoder = PaddleDecoder(model_version / "lm", {}, max_batch, "generate")
        self.prompt = self.tokenizer.encode(prompt)

    def measure(
        self, limits: StepLimits, concurrency: int, duration: float, draws: Sequence[int]
    ) -> tuple[int, float, list[float]]:
        """(tokens, seconds, times to first token) of a closed loop for `duration`; requests
        started by then run to their end and count."""
        engine = GenerationEngine(self.decoder, limits, Responses(self.tokenizer))
        lengths: Iterator[int] = iter(draws)
        lock = threading.Lock()
        totals, ttfts, errors = [0], [], []
        end = time.perf_counter() + duration

        def client() -> None:
            while time.perf_counter() < end:
                with lock:
                    max_tokens = next(lengths)
                sender = Sender()
                engine.submit(sender, self.prompt, max_tokens)
                if not sender.done.wait(WAIT_S) or sender.error:
                    errors.append(sender.error or "no final response")
                    return
                with lock:
                    totals[0] += sender.tokens
                    ttfts.append(sender.first)

        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        t0 = time.perf_counter()
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            engine.close()
        if errors:
            raise RuntimeError(f"engine bench: {errors[0]}")
        return totals[0], time.perf_counter() - t0, ttfts

    def warm_up(self, ways: Sequence[StepLimits]) -> None:
        for limits in ways:
            self.measure(limits, 4, 0.0, [8] * 4)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))
