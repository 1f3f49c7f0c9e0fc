"""A sequence belongs to whoever started it (service/batching/sequence_queue.py): whatever two
callers send, in any order, with starts, ends, plain requests, batches and idle timeouts
interleaved, a caller never runs, ends or restarts another's live sequence, is told nothing
about it beyond what a sequence that never started says (NOT_FOUND, the same words), and the
state a sequence carries only ever comes from its owner's requests. And a sequence id the
model's CORRID cannot hold exactly is refused (check_corrid)."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oip.datatypes import BY_NAME
from service.batching.sequence_queue import Live, SequencePolicy, SequenceQueue, Step
from service.batching.sequence_tensors import check_corrid, corrid_bytes
from service.inference import errors
from service.inference.identity import ANYONE, Identity
from service.inference.jobs import InferJob, InputTensor
from service.model.sequences import Control, ControlSpec, SequenceSettings

FP32 = BY_NAME["FP32"]
ALICE: Identity = (b"x509_common_name", b"alice")
BOB: Identity = (b"x509_common_name", b"bob")
CALLERS = (ALICE, BOB, ANYONE)


def job() -> InferJob:
    return InferJob((InputTensor("x", FP32, (1, 4), bytes(16)),), ("y",), 1)


def step(corrid: int, now: float, owner: Identity, start: bool, end: bool) -> Step:
    return Step(job(), corrid, start, end, now, None, owner=owner)


def policy() -> SequencePolicy:
    return SequencePolicy(oldest=False, instances=2, max_batch_size=2, max_candidates=4, idle_s=1.0)


def unknown_message(corrid: int) -> str:
    """What a request for a sequence that never started is told."""
    with pytest.raises(errors.ServiceError) as never:
        SequenceQueue(policy()).push(step(corrid, 0.0, ANYONE, False, False), 0.0)
    assert never.value.code == grpc.StatusCode.NOT_FOUND
    return never.value.message


def live_of(queue: SequenceQueue, corrid: int) -> Live | None:
    found = [live for who in CALLERS if (live := queue.sequence(corrid, who)) is not None]
    assert len(found) <= 1, "two live sequences hold one id"
    return found[0] if found else None


def mark(owner: Identity) -> bytes:
    """The state a request of `owner` leaves."""
    return owner[-1] if owner else b"anyone"


def snapshot(live: Live | None) -> object:
    if live is None:
        return None
    return (live.owner, list(live.waiting), live.closing, live.state, live.last_active)


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(("start", "next", "end", "start_end", "run", "idle")),
        st.integers(0, len(CALLERS) - 1),
        st.integers(1, 2),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(actions=ACTIONS)
def test_no_caller_touches_another_callers_sequence(
    actions: list[tuple[str, int, int]],
) -> None:
    queue = SequenceQueue(policy())
    unknown = {corrid: unknown_message(corrid) for corrid in (1, 2)}
    ended_by: dict[int | str, Identity] = {}  # who owned the last sequence of an id that ended
    running: list[Step] = []
    now = 0.0
    for kind, who, corrid in actions:
        now += 0.01
        caller = CALLERS[who]
        if kind == "run":  # the running batch ends; the next one starts
            for item in running:
                owner_live = queue.sequence(item.corrid, item.owner)
                if queue.finish(item, now, {"state": mark(item.owner)}, 1):
                    assert owner_live is not None
                    ended_by[item.corrid] = item.owner
            running = []
            action = queue.next_batch(now, [True, True])
            if isinstance(action, tuple):
                for item in action[1]:
                    assert queue.sequence(item.corrid, item.owner) is not None
                running = action[1]
        elif kind == "idle":  # long enough for every idle sequence to expire
            now += 2.0
            idle = {c: live_of(queue, c) for c in (1, 2)}
            queue.expire(now)
            for c, live in idle.items():
                if live is not None and live_of(queue, c) is None:
                    ended_by[c] = live.owner
        else:
            start, end = kind in ("start", "start_end"), kind in ("end", "start_end")
            held = live_of(queue, corrid)
            before = snapshot(held)
            item = step(corrid, now, caller, start, end)
            try:
                queue.push(item, now)
            except errors.ServiceError as exc:
                if held is not None and held.owner != caller:
                    if start:
                        assert exc.code == grpc.StatusCode.ALREADY_EXISTS
                    else:
                        assert (exc.code, exc.message) == (
                            grpc.StatusCode.NOT_FOUND,
                            unknown[corrid],
                        )
                    assert snapshot(live_of(queue, corrid)) == before, "another's changed"
                elif exc.code == grpc.StatusCode.NOT_FOUND:
                    assert exc.message == unknown[corrid]
                elif exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # "has ended", "expired": told only to the sequence's own caller.
                    owned = held is not None and held.owner == caller
                    assert owned or ended_by.get(corrid) == caller, exc.message
                continue
            assert held is None or held.owner == caller, "a request joined another's sequence"
        for c in (1, 2):
            live = live_of(queue, c)
            if live is None:
                continue
            assert all(w.owner == live.owner for w in live.waiting)
            assert live.state is None or live.state["state"] == mark(live.owner)


def corrid_settings(datatype: str) -> SequenceSettings:
    control = ControlSpec("CORRID", Control.CONTROL_SEQUENCE_CORRID, BY_NAME[datatype])
    return SequenceSettings(False, 1.0, (control,), (), 4, (), 0.0, 0.0)


@pytest.mark.parametrize(
    ("datatype", "corrid", "why"),
    [
        ("UINT32", 2**32 + 7, "does not fit"),
        ("INT32", 2**31, "does not fit"),
        ("INT64", 2**63, "does not fit"),
        ("UINT64", "42", "send sequence_id as an integer"),
        ("BYTES", 42, "send sequence_id as a string"),
    ],
)
def test_an_id_the_corrid_cannot_hold_exactly_is_refused(
    datatype: str, corrid: int | str, why: str
) -> None:
    with pytest.raises(errors.ServiceError) as refused:
        check_corrid(corrid, corrid_settings(datatype), "model 'm'")
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert why in refused.value.message and "CORRID" in refused.value.message


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    datatype=st.sampled_from(("UINT32", "INT32", "INT64", "UINT64")),
    first=st.integers(1, 2**64 - 1),
    second=st.integers(1, 2**64 - 1),
)
def test_two_ids_taken_never_present_the_same_corrid(
    datatype: str, first: int, second: int
) -> None:
    """Every id check_corrid takes is written exactly: distinct ids, distinct CORRIDs."""
    presented = []
    for corrid in (first, second):
        try:
            check_corrid(corrid, corrid_settings(datatype), "model 'm'")
        except errors.ServiceError:
            continue
        presented.append(corrid_bytes(corrid, BY_NAME[datatype]))
    if len(presented) == 2 and first != second:
        assert presented[0] != presented[1]
