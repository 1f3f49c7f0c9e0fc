"""The poison list's promises (README: refused for 10 minutes, at most 1024 per version), with
explicit times: what `make mutate` found no test for in service/resilience/poison.py."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from oip.datatypes import BY_NAME
from service.inference.jobs import InferJob, InputTensor
from service.resilience.poison import PoisonList, fingerprint

PROPERTY = settings(max_examples=25, deadline=None, derandomize=True, database=None)


def job(
    fill: int, name: str = "x", datatype: str = "FP32", shape: tuple[int, ...] = (1, 4)
) -> InferJob:
    data = np.full(4, fill, np.int32).tobytes()  # 16 bytes whatever the datatype and shape
    return InferJob((InputTensor(name, BY_NAME[datatype], shape, data),), ("y",), shape[0])


@PROPERTY
@given(added=st.floats(0, 1e6), before=st.floats(1e-3, 599.0))
def test_refused_for_ten_minutes_by_default(added: float, before: float) -> None:
    poison = PoisonList()
    poison.add(job(1), now=added)
    assert poison.holds(job(1), now=added + 600.0 - before)
    assert not poison.holds(job(1), now=added + 600.0)
    assert len(poison) == 0


def test_at_most_1024_entries_by_default_the_oldest_go_first() -> None:
    poison = PoisonList()
    for fill in range(1025):
        poison.add(job(fill), now=fill / 1025)
    assert len(poison) == 1024
    assert not poison.holds(job(0), now=1.0)
    assert poison.holds(job(1), now=1.0) and poison.holds(job(1024), now=1.0)


def test_the_same_bytes_under_another_name_datatype_or_shape_are_other_inputs() -> None:
    same_bytes = [job(7), job(7, name="w"), job(7, datatype="INT32"), job(7, shape=(2, 2))]
    assert len({fingerprint(j) for j in same_bytes}) == len(same_bytes)
    poison = PoisonList()
    poison.add(same_bytes[0], now=0.0)
    assert [poison.holds(j, now=1.0) for j in same_bytes] == [True, False, False, False]


def test_adding_again_renews_the_entry_and_its_place() -> None:
    poison = PoisonList(ttl_s=10.0, max_entries=2)
    poison.add(job(1), now=0.0)
    poison.add(job(2), now=1.0)
    poison.add(job(1), now=2.0)  # renewed: now the newest
    poison.add(job(3), now=3.0)  # full: job 2, the least recently added, goes
    assert not poison.holds(job(2), now=3.0)
    assert poison.holds(job(1), now=11.9) and poison.holds(job(3), now=11.9)


def test_expiry_drops_the_oldest_entries_only() -> None:
    poison = PoisonList(ttl_s=10.0)
    poison.add(job(1), now=0.0)
    poison.add(job(2), now=5.0)
    assert not poison.holds(job(1), now=10.0)
    assert poison.holds(job(2), now=10.0)
    assert len(poison) == 1
