"""The eviction policy of --model-memory-budget (service/lifecycle/eviction.py): least recently
used idle models first, as few as make room; pinned and busy models never; a load that cannot
fit evicts nothing and says why."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from service.lifecycle.eviction import MB, Evict, NoRoom, Resident, plan_room


def resident(name: str, mb: int, used: float, pinned: bool = False, busy: bool = False) -> Resident:
    return Resident(name, mb * MB, used, pinned, busy)


def test_the_least_recently_used_go_first_and_no_more_than_needed() -> None:
    models = [resident("a", 100, 3.0), resident("b", 100, 1.0), resident("c", 100, 2.0)]
    assert plan_room(models, 100 * MB, 300 * MB, "d") == Evict(("b",))
    assert plan_room(models, 200 * MB, 300 * MB, "d") == Evict(("b", "c"))


def test_pinned_and_busy_models_stay_even_when_oldest() -> None:
    models = [
        resident("pinned", 100, 0.0, pinned=True),
        resident("busy", 100, 0.0, busy=True),
        resident("idle", 100, 5.0),
    ]
    assert plan_room(models, 100 * MB, 300 * MB, "new") == Evict(("idle",))
    refused = plan_room(models, 200 * MB, 300 * MB, "new")
    assert isinstance(refused, NoRoom)
    assert "busy, pinned" in refused.reason


def test_a_model_larger_than_the_budget_is_refused_naming_both() -> None:
    refused = plan_room([], 300 * MB, 200 * MB, "huge")
    assert isinstance(refused, NoRoom)
    assert "'huge' needs 300.0 MB" in refused.reason
    assert "--model-memory-budget of 200.0 MB" in refused.reason


def test_a_reload_keeps_the_model_it_replaces_counted() -> None:
    """The old version serves until the new one takes over: both are in memory."""
    models = [resident("a", 100, 0.0), resident("b", 100, 1.0)]
    assert plan_room(models, 100 * MB, 300 * MB, "a") == Evict(())
    assert plan_room(models, 150 * MB, 300 * MB, "a") == Evict(("b",))


residents = st.lists(
    st.builds(
        Resident,
        name=st.text("abcdefgh", min_size=1, max_size=3),
        bytes=st.integers(0, 1000),
        last_used=st.integers(0, 20).map(float),
        pinned=st.booleans(),
        busy=st.booleans(),
    ),
    max_size=8,
    unique_by=lambda r: r.name,
)


@given(residents, st.integers(0, 1500), st.integers(0, 3000), st.text("abcdefgh", max_size=3))
def test_plans_keep_the_invariants(
    models: list[Resident], needed: int, budget: int, loading: str
) -> None:
    """Evicted: only idle, unpinned, other models that free something, a prefix of them by
    last use (ties by name), none more than needed, and then the load fits. Refused: only
    when evicting every one of them would not make room."""
    plan = plan_room(models, needed, budget, loading)
    used = sum(r.bytes for r in models)
    candidates = sorted(
        (r for r in models if r.bytes and not r.pinned and not r.busy and r.name != loading),
        key=lambda r: (r.last_used, r.name),
    )
    if isinstance(plan, NoRoom):
        assert needed > budget or used - sum(r.bytes for r in candidates) + needed > budget
        return
    chosen = list(plan.names)
    assert chosen == [r.name for r in candidates[: len(chosen)]]
    freed = sum(r.bytes for r in candidates[: len(chosen)])
    assert used - freed + needed <= budget
    if chosen:
        last = candidates[len(chosen) - 1].bytes
        assert used - (freed - last) + needed > budget  # one fewer would not fit
