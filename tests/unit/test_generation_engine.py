"""The generation engine (service/backend/generation/engine.py) with the exported decoder LM
of the `generate` example (`make models`), in-process: the engine is what is under test, so
each request's response sender is a small recorder (the worker's real sender is tested with
the worker)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.backend.generation.decoder import PaddleDecoder
from service.backend.generation.engine import (
    DEFAULT_LIMITS,
    FINAL,
    MAX_BATCH,
    MODE,
    TOKEN_BUDGET,
    GenerationEngine,
    StepRecord,
    limits_from,
)
from service.backend.generation.planner import Mode, StepLimits
from service.backend.generation.tokenizer import CharTokenizer
from service.model.parameters import ParameterError
from tests.servers import EXAMPLE_MODELS

MODEL = EXAMPLE_MODELS / "generate" / "1"
PROPERTY = settings(max_examples=6, deadline=None, derandomize=True, database=None)
WAIT_S = 120.0  # a ceiling for waits that end on an event, never a measured time
prompts = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=24)


class Recorder:
    """A response sender and its request: records what the engine sends. `credit`: how many
    more data responses its reader takes before it stops reading (None: it never stops), as
    the worker's sender has a window of responses the server has not taken yet (a final
    response needs no credit there)."""

    def __init__(self, credit: int | None = None, gate: threading.Event | None = None) -> None:
        """`gate`: once set, the reader reads on (one event can release many readers at
        once)."""
        self.sent: list[tuple[str, Any]] = []
        self.finished = threading.Event()
        self.credit, self.gate = credit, gate
        self.cancel = False
        self._lock = threading.Lock()

    # the request's side
    def get_response_sender(self) -> Recorder:
        return self

    def is_cancelled(self) -> bool:
        return self.cancel

    def request_id(self) -> str:
        return f"recorder-{id(self)}"

    # the sender's side
    def writable(self) -> bool:
        with self._lock:
            return self._reading()

    def _reading(self) -> bool:
        gate_open = self.gate is not None and self.gate.is_set()
        return self.credit is None or self.credit > 0 or gate_open

    def send(self, response: Any = None, flags: int = 0) -> None:
        with self._lock:
            assert not self.finished.is_set(), "sent after the final flag"
            if not self.cancel and not flags & FINAL:
                # The worker's sender would block the engine's thread here.
                assert self._reading(), "sent while not writable"
                if self.credit is not None and self.credit > 0:
                    self.credit -= 1
            self.sent.append(("flags-only", None) if response is None else response)
            if flags & FINAL:
                self.finished.set()

    def read_on(self) -> None:
        with self._lock:
            self.credit = None

    def tokens(self) -> list[int]:
        return [value for kind, value in self.sent if kind == "token"]

    def ending(self) -> tuple[str, Any]:
        assert self.finished.wait(WAIT_S)
        return self.sent[-1]


class Responses:
    def token(self, token: int) -> tuple[str, int]:
        return ("token", token)

    def final(self, reason: str) -> tuple[str, str]:
        return ("final", reason)

    def error(self, message: str) -> tuple[str, str]:
        return ("error", message)


@dataclass
class Steps:
    """The engine's observer: every step's record, and a way to wait for the next ones."""

    records: list[StepRecord] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def __call__(self, record: StepRecord) -> None:
        with self.changed:
            self.records.append(record)
            self.changed.notify_all()

    def wait_for(self, count: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.records) >= count, WAIT_S)


@pytest.fixture(scope="module")
def decoder() -> PaddleDecoder:
    if not (MODEL / "lm").is_dir():
        pytest.fail(f"{MODEL} has no exported LM; run `make models`")
    return PaddleDecoder(MODEL / "lm", {}, 32, "generate")


@pytest.fixture(scope="module")
def tokenizer() -> CharTokenizer:
    return CharTokenizer(MODEL / "vocab.json")


@contextmanager
def started(
    decoder: PaddleDecoder, max_batch: int = 32, budget: int = 512, mode: Mode = "iteration"
) -> Iterator[tuple[GenerationEngine, Steps]]:
    """An engine over the module's decoder (one runs at a time), closed afterwards."""
    steps = Steps()
    engine = GenerationEngine(decoder, StepLimits(max_batch, budget, mode), Responses(), steps)
    try:
        yield engine, steps
    finally:
        engine.close()


def run(
    engine: GenerationEngine, jobs: Sequence[tuple[list[int], int]], **options: Any
) -> list[Recorder]:
    recorders = [Recorder() for _ in jobs]
    for recorder, (prompt, max_tokens) in zip(recorders, jobs, strict=True):
        engine.submit(recorder, prompt, max_tokens, **options)
    for recorder in recorders:
        recorder.ending()
    return recorders


def alone(engine: GenerationEngine, jobs: Sequence[tuple[list[int], int]]) -> list[list[int]]:
    return [run(engine, [job])[0].tokens() for job in jobs]


jobs_strategy = st.lists(st.tuples(prompts, st.integers(1, 40)), min_size=2, max_size=8)


@PROPERTY
@given(jobs_strategy)
def test_greedy_output_is_the_same_alone_and_in_any_batch(
    decoder: PaddleDecoder, tokenizer: CharTokenizer, texts: list[tuple[str, int]]
) -> None:
    """Each reader takes one response and waits for the others to be prefilled (a shared
    gate), so every sequence decodes in one batch with all the others."""
    with started(decoder) as (engine, steps):
        jobs = [(tokenizer.encode(text), max_tokens) for text, max_tokens in texts]
        expected = alone(engine, jobs)
        steps.records.clear()
        gate = threading.Event()
        together = [Recorder(credit=1, gate=gate) for _ in jobs]
        for recorder, job in zip(together, jobs, strict=True):
            engine.submit(recorder, *job)
        with steps.changed:
            prefilled = lambda: sum(len(r.prefilled) for r in steps.records) == len(jobs)  # noqa: E731
            assert steps.changed.wait_for(prefilled, WAIT_S)
        gate.set()
        assert [r.ending() for r in together] == [("final", "length")] * len(jobs)
        assert [r.tokens() for r in together] == expected
        assert [len(t) for t in expected] == [m for _, m in jobs]
        assert max(r.decoded for r in steps.records) == sum(m > 1 for _, m in jobs)


def test_sequences_join_and_leave_between_steps(
    decoder: PaddleDecoder, tokenizer: CharTokenizer
) -> None:
    """A request that arrives while another runs joins the batch at once (not when it has
    drained), one that ends leaves while the others go on, and each one's tokens are still
    those it gets alone. The long one's reader stops after 20 responses until the late one
    is in, so the late one arrives while it is unfinished however slow this thread is."""
    with started(decoder) as (engine, steps):
        long, short = (tokenizer.encode("a long one"), 60), (tokenizer.encode("hi"), 5)
        late = (tokenizer.encode("late"), 10)
        expected = alone(engine, [long, short, late])
        steps.records.clear()
        gate = threading.Event()
        first = [Recorder(credit=20, gate=gate), Recorder()]
        engine.submit(first[0], *long)
        engine.submit(first[1], *short)
        steps.wait_for(2)
        third = Recorder()
        engine.submit(third, *late)
        gate.set()
        for recorder in (*first, third):
            recorder.ending()
        assert [r.tokens() for r in (*first, third)] == expected
        # The late prompt's length is unique here: its prefill is found whoever shares its
        # step (on a busy machine the short one can be prefilled in the same step).
        (joined,) = [r for r in steps.records if len(late[0]) in r.prefilled]
        assert joined.held >= 2  # it did not wait for the long one to end
        helds = [r.held for r in steps.records]
        left = [i for i in range(1, len(helds)) if helds[i] < helds[i - 1]]
        assert left and left[0] < len(helds) - 1  # someone left, and steps went on


def test_a_cancelled_sequence_stops_being_stepped_and_frees_its_place(
    decoder: PaddleDecoder, tokenizer: CharTokenizer
) -> None:
    """A batch of one: the cancelled sequence (its reader stopped after 5 responses) gets a
    flags-only final, is never stepped again, and the waiting one joins at the next step."""
    with started(decoder, max_batch=1, budget=16) as (engine, steps):
        cancelled, waiting = Recorder(credit=5), Recorder()
        generation = engine.submit(cancelled, tokenizer.encode("cancel me"), 200)
        engine.submit(waiting, tokenizer.encode("next"), 5)
        steps.wait_for(5)
        cancelled.cancel = True
        assert cancelled.ending() == ("flags-only", None)
        assert waiting.ending() == ("final", "length")
        assert len(waiting.tokens()) == 5
        assert generation.steps == 5 and len(cancelled.tokens()) == 5
        assert [r.prefilled for r in steps.records[5:7]] == [(4,), ()]
        assert len(steps.records) == 5 + 5


def test_an_unwritable_sequence_pauses_and_resumes_with_the_same_output(
    decoder: PaddleDecoder, tokenizer: CharTokenizer
) -> None:
    """Its reader takes 10 responses, then stops: the sequence is not stepped while the other
    one goes on (to 25 responses, where its own reader stops), and once the reader reads on it
    ends as it does alone."""
    with started(decoder) as (engine, _steps):
        paused_job, other_job = (tokenizer.encode("slow reader"), 30), (tokenizer.encode("x"), 60)
        expected = alone(engine, [paused_job])[0]
        paused, other = Recorder(credit=10), Recorder(credit=25)
        generation = engine.submit(paused, *paused_job)
        engine.submit(other, *other_job)
        deadline = time.monotonic() + WAIT_S  # the tokens go out after the step's record
        while len(other.tokens()) < 25:
            assert time.monotonic() < deadline, "the other sequence stopped short"
            time.sleep(0.005)
        assert generation.steps == 10
        assert not other.finished.is_set()
        other.read_on()
        paused.read_on()
        assert paused.ending() == ("final", "length")
        assert paused.tokens() == expected
        assert other.ending() == ("final", "length")


@settings(max_examples=5, deadline=None, derandomize=True, database=None)
@given(
    st.integers(1, 6),
    st.integers(0, 24),
    st.lists(st.tuples(prompts, st.integers(1, 12)), min_size=3, max_size=10),
)
def test_every_step_keeps_to_the_token_budget_and_the_batch_size(
    decoder: PaddleDecoder,
    tokenizer: CharTokenizer,
    max_batch: int,
    extra_budget: int,
    texts: list[tuple[str, int]],
) -> None:
    budget = max(max_batch, 24) + extra_budget  # every prompt (<= 24 tokens) fits alone
    with started(decoder, max_batch=max_batch, budget=budget) as (engine, steps):
        jobs = [(tokenizer.encode(text), max_tokens) for text, max_tokens in texts]
        expected = alone(engine, jobs)
        steps.records.clear()
        assert [r.tokens() for r in run(engine, jobs)] == expected
        assert all(r.tokens <= budget and r.held <= max_batch for r in steps.records)


def test_request_mode_runs_each_batch_to_its_end(
    decoder: PaddleDecoder, tokenizer: CharTokenizer
) -> None:
    with started(decoder, max_batch=4, mode="request") as (engine, steps):
        jobs = [(tokenizer.encode(f"prompt {i}"), 3 + 7 * i) for i in range(6)]
        expected = alone(engine, jobs)
        steps.records.clear()
        assert [r.tokens() for r in run(engine, jobs)] == expected
        previous = 0
        for record in steps.records:
            if record.prefilled:
                assert record.decoded == 0 and record.held == len(record.prefilled)
            else:
                assert record.held <= previous
            previous = record.held


def test_a_stop_token_ends_the_sequence(decoder: PaddleDecoder, tokenizer: CharTokenizer) -> None:
    with started(decoder) as (engine, _):
        job = (tokenizer.encode("stop somewhere"), 20)
        tokens = alone(engine, [job])[0]
        stop = tokens[len(tokens) // 2]
        (recorder,) = run(engine, [job], stop_ids=[stop])
        assert recorder.tokens() == tokens[: tokens.index(stop)]
        assert recorder.ending() == ("final", "stop")


def test_seeded_sampling_draws_the_same_tokens_in_any_batch(
    decoder: PaddleDecoder, tokenizer: CharTokenizer
) -> None:
    with started(decoder) as (engine, _):
        jobs = [(tokenizer.encode(text), 25) for text in ("one", "two two", "three")]
        sampled = [run(engine, [job], temperature=1.0, seed=7)[0].tokens() for job in jobs]
        together = run(engine, jobs, temperature=1.0, seed=7)
        assert [r.tokens() for r in together] == sampled
        assert sampled != alone(engine, jobs)  # it did sample


def test_a_request_the_engine_cannot_run_is_refused_when_submitted(
    decoder: PaddleDecoder,
) -> None:
    with started(decoder, max_batch=2, budget=8) as (engine, steps):
        with pytest.raises(ValueError, match=TOKEN_BUDGET):
            engine.submit(Recorder(), [5] * 9, 1)
        with pytest.raises(ValueError, match="context"):
            engine.submit(Recorder(), [5] * 8, decoder.cache.context)
        with pytest.raises(ValueError, match="max_tokens"):
            engine.submit(Recorder(), [5], 0)
        assert steps.records == []


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        ({MAX_BATCH: "0"}, MAX_BATCH),
        ({MAX_BATCH: "many"}, MAX_BATCH),
        ({TOKEN_BUDGET: "-1"}, TOKEN_BUDGET),
        ({MAX_BATCH: "8", TOKEN_BUDGET: "7"}, TOKEN_BUDGET),
        ({MODE: "orca"}, MODE),
    ],
)
def test_a_bad_engine_parameter_is_refused_by_name(parameters: dict[str, str], named: str) -> None:
    with pytest.raises(ParameterError, match=named):
        limits_from(parameters)


def test_engine_parameters_default_to_iteration_level_batching() -> None:
    assert limits_from({}) == DEFAULT_LIMITS
    assert limits_from({MAX_BATCH: "4", TOKEN_BUDGET: "4", MODE: "request"}) == StepLimits(
        4, 4, "request"
    )


@settings(max_examples=4, deadline=None, derandomize=True, database=None)
@given(prompts, st.integers(2, 30))
def test_the_cache_gives_the_tokens_of_recomputing_the_whole_prefix(
    decoder: PaddleDecoder, tokenizer: CharTokenizer, text: str, max_tokens: int
) -> None:
    """Each greedy token is the one the prefill program picks for the prompt and every token
    before it (no cache): the engine puts each key and value at its position."""
    with started(decoder) as (engine, _):
        prompt = tokenizer.encode(text)
        (recorder,) = run(engine, [(prompt, max_tokens)])
    tokens = recorder.tokens()
    recomputed = [int(decoder.prefill(prompt + tokens[:i])[0].argmax()) for i in range(len(tokens))]
    assert tokens == recomputed


def test_closing_the_engine_fails_what_is_unfinished(
    decoder: PaddleDecoder, tokenizer: CharTokenizer
) -> None:
    """A batch of one at close: a finished sequence whose reader stopped (its final response
    went out anyway: it needs no credit), a paused one holding the place and one waiting for
    it. Each unfinished one gets an error, and close returns."""
    unread, paused, waiting = Recorder(credit=4), Recorder(credit=3), Recorder()
    with started(decoder, max_batch=1, budget=64) as (engine, steps):
        engine.submit(unread, tokenizer.encode("done"), 4)
        engine.submit(paused, tokenizer.encode("paused"), 50)
        engine.submit(waiting, tokenizer.encode("waits"), 5)
        steps.wait_for(4 + 3)
    assert unread.ending() == ("final", "length") and len(unread.tokens()) == 4
    assert paused.ending() == ("error", "the model is shutting down")
    assert len(paused.tokens()) == 3
    assert waiting.ending() == ("error", "the model is shutting down")
    assert waiting.tokens() == []


class FailingPrefill:
    """The module's decoder whose prefill raises: a step that fails before a joiner has its
    place."""

    def __init__(self, decoder: PaddleDecoder) -> None:
        self.decoder, self.cache = decoder, decoder.cache

    def prefill(self, token_ids: list[int]) -> Any:
        raise RuntimeError("prefill broke")

    def decode(self, *args: Any) -> Any:
        return self.decoder.decode(*args)


def test_a_failed_prefill_fails_every_joiner_it_had_not_reached(
    decoder: PaddleDecoder, tokenizer: CharTokenizer
) -> None:
    engine = GenerationEngine(FailingPrefill(decoder), StepLimits(32, 512), Responses())  # type: ignore[arg-type]
    try:
        recorders = [Recorder() for _ in range(3)]
        for recorder in recorders:
            engine.submit(recorder, tokenizer.encode("hello"), 5)
        endings = [r.ending() for r in recorders]
    finally:
        engine.close()
    assert endings == [("error", "generation step failed: prefill broke")] * 3
    assert all(r.tokens() == [] for r in recorders)
