"""The step planner (service/backend/generation/planner.py): who joins the batch at a step."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from service.backend.generation.planner import MODES, StepLimits, joiners

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)


@st.composite
def situations(draw: st.DrawFn) -> tuple[int, int, list[int], StepLimits]:
    max_batch = draw(st.integers(1, 16))
    budget = draw(st.integers(max_batch, 64))
    held = draw(st.integers(0, max_batch))
    decoding = draw(st.integers(0, held))
    # The engine refuses prompts longer than the budget when they are submitted.
    waiting = draw(st.lists(st.integers(1, budget), max_size=12))
    return held, decoding, waiting, StepLimits(max_batch, budget, draw(st.sampled_from(MODES)))


@PROPERTY
@given(situations())
def test_the_joiners_fit_the_batch_and_the_token_budget(
    situation: tuple[int, int, list[int], StepLimits],
) -> None:
    held, decoding, waiting, limits = situation
    count = joiners(held, decoding, waiting, limits)
    assert 0 <= count <= len(waiting)
    assert held + count <= limits.max_batch
    assert decoding + sum(waiting[:count]) <= limits.token_budget


@PROPERTY
@given(situations())
def test_it_admits_as_many_as_fit_in_arrival_order(
    situation: tuple[int, int, list[int], StepLimits],
) -> None:
    """The next waiting sequence was left out only because it did not fit (or the request
    mode's batch is still running): a prefix, and the longest one that fits."""
    held, decoding, waiting, limits = situation
    count = joiners(held, decoding, waiting, limits)
    if count == len(waiting):
        return
    fits = (
        held + count + 1 <= limits.max_batch
        and decoding + sum(waiting[: count + 1]) <= limits.token_budget
    )
    request_batch_running = limits.mode == "request" and held > 0
    assert request_batch_running or not fits


@PROPERTY
@given(situations())
def test_an_empty_batch_always_admits_its_first_waiting_sequence(
    situation: tuple[int, int, list[int], StepLimits],
) -> None:
    _, _, waiting, limits = situation
    assert (joiners(0, 0, waiting, limits) >= 1) == bool(waiting)


@PROPERTY
@given(situations())
def test_request_mode_forms_a_batch_only_when_the_last_one_ended(
    situation: tuple[int, int, list[int], StepLimits],
) -> None:
    held, decoding, waiting, limits = situation
    request = StepLimits(limits.max_batch, limits.token_budget, "request")
    iteration = StepLimits(limits.max_batch, limits.token_budget, "iteration")
    if held:
        assert joiners(held, decoding, waiting, request) == 0
    else:
        assert joiners(0, 0, waiting, request) == joiners(0, 0, waiting, iteration)


def test_a_paused_sequence_holds_its_place_but_not_its_tokens() -> None:
    """Three held, one decoding: one place left, budget left for a prompt of 7."""
    limits = StepLimits(max_batch=4, token_budget=8)
    assert joiners(3, 1, [7, 1], limits) == 1
    assert joiners(3, 3, [7], limits) == 0
