"""The wait-for graph of BLS calls (service/inference/waits.py): which instances can never run
again, against a brute-force search on random call patterns; admitting only waits that block
nobody keeps the graph free of cycles whatever the order; and the patterns the server meets
(a model calling itself with several instances, two requests at once; chains that end)."""

from __future__ import annotations

import itertools
from contextlib import ExitStack

from hypothesis import given
from hypothesis import strategies as st

from service.inference.waits import Wait, WaitGraph, stuck

INSTANCES = range(6)

waits_strategy = st.lists(
    st.builds(
        Wait,
        st.sampled_from(INSTANCES),
        st.frozensets(st.sampled_from(INSTANCES), min_size=1, max_size=3),
    ),
    max_size=10,
)


def stuck_by_search(waits: list[Wait]) -> frozenset[int]:
    """The union of every set of waiters each of which has a wait on members of the set only:
    none of them can be the first to run again."""
    waiters = sorted({w.waiter for w in waits})
    found: set[int] = set()
    for size in range(1, len(waiters) + 1):
        for group in map(frozenset, itertools.combinations(waiters, size)):
            if all(any(w.waiter == x and w.on <= group for w in waits) for x in group):
                found |= group
    return frozenset(found)


@given(waits_strategy)
def test_stuck_is_what_a_search_of_every_group_finds(waits: list[Wait]) -> None:
    assert stuck(waits) == stuck_by_search(waits)


@given(waits_strategy, st.data())
def test_an_answer_never_sticks_anyone(waits: list[Wait], data: st.DataObject) -> None:
    if not waits:
        return
    gone = data.draw(st.integers(0, len(waits) - 1))
    assert stuck(waits[:gone] + waits[gone + 1 :]) <= stuck(waits)


@given(st.lists(st.tuples(st.booleans(), waits_strategy.map(tuple)), max_size=20))
def test_admitting_only_what_blocks_nobody_keeps_every_instance_free(
    steps: list[tuple[bool, tuple[Wait, ...]]],
) -> None:
    """Calls and batches come and go in any order; each is admitted only if it blocks none of
    its waiters: then no instance is ever stuck, and what ended leaves nothing behind."""
    graph = WaitGraph()
    held: list[tuple[tuple[Wait, ...], ExitStack]] = []
    for ends_one, waits in steps:
        if ends_one and held:
            held.pop(0)[1].close()
        elif not graph.blocks(waits):
            stack = ExitStack()
            stack.enter_context(graph.added(waits))
            held.append((waits, stack))
        assert stuck(w for waits, _ in held for w in waits) == frozenset()
    for _, stack in held:
        stack.close()
    assert len(graph) == 0


def test_a_model_calling_itself_with_two_instances_twice_at_once() -> None:
    """A1 and A2 each run a request of A that calls A: the first call is admitted (A2 may run
    it), and may go to A2 but not behind A1's own batch; the second closes the cycle."""
    a1, a2 = 1, 2
    model_a = frozenset({a1, a2})
    graph = WaitGraph()
    first = (Wait(a1, model_a),)
    assert not graph.blocks(first)
    with graph.added(first):
        assert graph.blocks((Wait(a1, frozenset({a1})),))  # sent behind its own caller
        assert not graph.blocks((Wait(a1, frozenset({a2})),))
        assert graph.blocks((Wait(a2, model_a),))  # the second request's call
        with graph.added((Wait(a1, frozenset({a2})),)):  # the first call queued on A2
            # A2, running that call's batch, calls A: both its callers wait on it.
            assert graph.blocks((Wait(a2, model_a),))
    assert len(graph) == 0


def test_a_chain_that_ends_is_never_refused() -> None:
    """A's two instances call B (one instance), which calls C: all at once, nobody is stuck."""
    a1, a2, b1, c1 = 1, 2, 3, 4
    graph = WaitGraph()
    with (
        graph.added((Wait(a1, frozenset({b1})),)),
        graph.added((Wait(a2, frozenset({b1})),)),
        graph.added((Wait(a1, frozenset({b1})), Wait(a2, frozenset({b1})))),  # sent to B1
    ):
        assert not graph.blocks((Wait(b1, frozenset({c1})),))
        # ...but B calling A back closes a cycle through the calls of both requests.
        assert graph.blocks((Wait(b1, frozenset({a1, a2})),))


def test_a_wait_on_nothing_never_ends_and_no_wait_blocks_nothing() -> None:
    assert stuck([Wait(1, frozenset())]) == {1}
    assert not WaitGraph().blocks(())
