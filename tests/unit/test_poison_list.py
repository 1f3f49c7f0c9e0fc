"""The poison list's promise (docs/model-repository.md, "Poison inputs"): an input found
poisonous is refused for 10 minutes, at most 1024 are remembered per model version, and the
oldest goes first. Times are explicit (the list takes `now`), so nothing sleeps."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from oip.datatypes import BY_NAME
from service.batching.batcher import DynamicBatcher
from service.batching.queue import BatchPolicy
from service.inference.jobs import InferJob, InputTensor
from service.resilience.poison import PoisonList, fingerprint

TEN_MINUTES_S = 600.0
REMEMBERED = 1024
PROFILE = settings(max_examples=30, deadline=None, derandomize=True, database=None)


def job(n: int) -> InferJob:
    """A distinct input per `n` (its bytes differ)."""
    data = np.array([n], np.int64).tobytes()
    return InferJob((InputTensor("x", BY_NAME["INT64"], (1, 1), data),), ("y",), 1)


def served_list() -> PoisonList:
    """The list a model version's batcher keeps (one per version), as the server builds it."""

    async def never_runs(*_: object) -> object:
        raise AssertionError("no batch runs here")

    return DynamicBatcher(BatchPolicy(max_batch_size=1), never_runs, lambda: 1).poison  # type: ignore[arg-type]


@PROFILE
@given(
    added=st.floats(0, 1e6, allow_nan=False),
    after=st.floats(0, TEN_MINUTES_S, exclude_max=True, allow_nan=False),
)
def test_a_poison_input_is_refused_for_ten_minutes(added: float, after: float) -> None:
    poison = served_list()
    poison.add(job(13), now=added)
    assert poison.holds(job(13), now=added + after)
    assert not poison.holds(job(14), now=added + after)


@PROFILE
@given(
    added=st.floats(0, 1e6, allow_nan=False),
    after=st.floats(TEN_MINUTES_S, 1e6, allow_nan=False),
)
def test_a_poison_input_is_forgotten_after_ten_minutes(added: float, after: float) -> None:
    poison = served_list()
    poison.add(job(13), now=added)
    assert not poison.holds(job(13), now=added + after)
    assert len(poison) == 0


@settings(PROFILE, max_examples=8)  # each example fills the list
@given(extra=st.integers(1, 40))
def test_at_most_1024_are_remembered_and_the_oldest_goes_first(extra: int) -> None:
    poison = served_list()
    total = REMEMBERED + extra
    for n in range(total):
        poison.add(job(n), now=float(n) * 0.001)  # all well within ten minutes
    assert len(poison) == REMEMBERED
    now = total * 0.001
    assert not any(poison.holds(job(n), now) for n in range(extra))  # the oldest went
    assert all(poison.holds(job(n), now) for n in range(extra, total))


def test_adding_an_input_again_restarts_its_ten_minutes_and_its_place() -> None:
    poison = served_list()
    poison.add(job(0), now=0.0)
    for n in range(1, REMEMBERED):
        poison.add(job(n), now=1.0)
    poison.add(job(0), now=500.0)  # found poisonous again: now the newest
    poison.add(job(REMEMBERED), now=501.0)  # one more than fits: job(1) goes, not job(0)
    assert not poison.holds(job(1), now=501.0)
    assert poison.holds(job(0), now=500.0 + TEN_MINUTES_S - 1.0)


def test_each_version_has_its_own_list() -> None:
    first, second = served_list(), served_list()
    first.add(job(7), now=0.0)
    assert first.holds(job(7), now=1.0) and not second.holds(job(7), now=1.0)


def _shaped(fill: int, name: str, datatype: str, shape: tuple[int, ...]) -> InferJob:
    data = np.full(4, fill, np.int32).tobytes()  # 16 bytes whatever the datatype and shape
    return InferJob((InputTensor(name, BY_NAME[datatype], shape, data),), ("y",), shape[0])


def test_the_same_bytes_under_another_name_datatype_or_shape_are_other_inputs() -> None:
    same_bytes = [
        _shaped(7, "x", "FP32", (1, 4)),
        _shaped(7, "w", "FP32", (1, 4)),
        _shaped(7, "x", "INT32", (1, 4)),
        _shaped(7, "x", "FP32", (2, 2)),
    ]
    assert len({fingerprint(j) for j in same_bytes}) == len(same_bytes)
    poison = PoisonList()
    poison.add(same_bytes[0], now=0.0)
    assert [poison.holds(j, now=1.0) for j in same_bytes] == [True, False, False, False]


def test_expiry_drops_the_oldest_entries_only() -> None:
    poison = PoisonList(ttl_s=10.0)
    poison.add(job(1), now=0.0)
    poison.add(job(2), now=5.0)
    assert not poison.holds(job(1), now=10.0)
    assert poison.holds(job(2), now=10.0)
    assert len(poison) == 1
