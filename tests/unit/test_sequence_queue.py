"""The sequence batcher's decisions (service/batching/sequence_queue.py), with explicit time:
whatever order requests of many sequences arrive in and batches finish in, a batch holds at
most one request of a sequence and only sequences of its instance, each sequence's requests
run one at a time and in order, and the bounds hold."""

from __future__ import annotations

from collections import defaultdict

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oip.datatypes import BY_NAME
from service.batching.sequence_queue import (
    ENDED_REMEMBERED,
    MAX_WAITING_PER_SEQUENCE,
    SequencePolicy,
    SequenceQueue,
    Step,
)
from service.inference import errors
from service.inference.identity import ANYONE
from service.inference.jobs import InferJob, InputTensor

FP32 = BY_NAME["FP32"]


def job(width: int = 4) -> InferJob:
    return InferJob((InputTensor("x", FP32, (1, width), bytes(4 * width)),), ("y",), 1)


def step(corrid: int | str, now: float, start: bool = False, end: bool = False) -> Step:
    return Step(job(), corrid, start, end, now, None)


def policy(oldest: bool = False, **changes: object) -> SequencePolicy:
    fields: dict[str, object] = {
        "oldest": oldest,
        "instances": 2,
        "max_batch_size": 4,
        "max_candidates": 8,
        "idle_s": 1.0,
    }
    fields.update(changes)
    return SequencePolicy(**fields)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    oldest=st.booleans(),
    instances=st.integers(1, 3),
    max_batch_size=st.integers(0, 4),
    sequences=st.integers(1, 6),
    length=st.integers(1, 4),
    actions=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.booleans()), max_size=80),
)
def test_batches_keep_each_sequence_in_order_one_at_a_time(
    oldest: bool,
    instances: int,
    max_batch_size: int,
    sequences: int,
    length: int,
    actions: list[tuple[int, int, bool]],
) -> None:
    limit = max(max_batch_size, 1) * instances if not oldest else 4  # the bound expected
    queue = SequenceQueue(
        policy(oldest, instances=instances, max_batch_size=max_batch_size, max_candidates=4)
    )
    sent: dict[int | str, int] = defaultdict(int)  # per sequence: requests pushed
    handed: dict[int | str, list[int]] = defaultdict(list)  # per sequence: request numbers run
    running: dict[int | str, int] = {}  # sequence -> the request number running
    in_flight: list[tuple[int, list[Step]]] = []
    numbers: dict[int, int] = {}  # id(step) -> its number in its sequence
    now = 0.0
    for kind, which, flag in actions:
        now += 0.001
        corrid = which % sequences + 1
        if kind == 0 and sent[corrid] < length:  # the sequence's next request
            index = sent[corrid]
            item = step(corrid, now, start=index == 0, end=index == length - 1)
            try:
                queue.push(item, now)
            except errors.ServiceError as exc:
                assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert index == 0 and queue.live == limit
                continue
            numbers[id(item)] = index
            sent[corrid] += 1
            assert queue.live <= limit
        elif kind == 1:  # the scheduler looks, with instances busy at random
            free = [flag or i % 2 == 0 for i in range(instances)]
            action = queue.next_batch(now + 1.0, free)
            if isinstance(action, tuple):
                instance, batch = action
                assert free[instance]
                assert 0 < len(batch) <= max(max_batch_size, 1)
                corrids = [s.corrid for s in batch]
                assert len(set(corrids)) == len(corrids), "two requests of one sequence"
                for item in batch:
                    live = queue.sequence(item.corrid, ANYONE)
                    assert live is not None and live.instance == instance
                    assert item.corrid not in running, "a sequence ran two requests at once"
                    running[item.corrid] = numbers[id(item)]
                    handed[item.corrid].append(numbers[id(item)])
                if not oldest:
                    slots = [queue.sequence(c, ANYONE).slot for c in corrids]  # type: ignore[union-attr]
                    assert slots == sorted(slots)
                in_flight.append((instance, batch))
        elif in_flight:  # a batch ends
            _, batch = in_flight.pop(which % len(in_flight))
            for item in batch:
                del running[item.corrid]
                queue.finish(item, now, {"state": b"x"}, 1)
    for key, ran in handed.items():
        assert ran == list(range(len(ran))), f"sequence {key} ran out of order: {ran}"


def test_direct_gives_each_live_sequence_its_own_slot() -> None:
    queue = SequenceQueue(policy(instances=2, max_batch_size=3))
    for corrid in range(1, 7):
        queue.push(step(corrid, 0.0, start=True), 0.0)
    places = {(s.instance, s.slot) for c in range(1, 7) if (s := queue.sequence(c, ANYONE))}
    assert places == {(i, slot) for i in range(2) for slot in range(3)}
    with pytest.raises(errors.ServiceError) as full:
        queue.push(step(7, 0.0, start=True), 0.0)
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "maximum of 6 live sequences" in full.value.message
    assert "max_batch_size 3 x 2 instance(s)" in full.value.message


def test_an_ended_sequence_frees_its_place_and_says_it_ended() -> None:
    queue = SequenceQueue(policy(instances=1, max_batch_size=1))
    first = step(1, 0.0, start=True, end=True)
    queue.push(first, 0.0)
    action = queue.next_batch(0.0, [True, True])
    assert isinstance(action, tuple)
    assert queue.finish(first, 0.1, {"s": b""}, 1) is True
    assert queue.live == 0
    with pytest.raises(errors.ServiceError) as ended:
        queue.push(step(1, 0.2), 0.2)
    assert (
        ended.value.code == grpc.StatusCode.INVALID_ARGUMENT and "has ended" in ended.value.message
    )
    queue.push(step(2, 0.3, start=True), 0.3)  # the place is free again


def test_a_request_after_the_end_request_is_refused_until_a_new_start() -> None:
    queue = SequenceQueue(policy())
    queue.push(step(1, 0.0, start=True), 0.0)
    queue.push(step(1, 0.0, end=True), 0.0)
    with pytest.raises(errors.ServiceError) as closed:
        queue.push(step(1, 0.0), 0.0)
    assert "has ended" in closed.value.message
    queue.push(step(1, 0.0, start=True), 0.0)  # a new start may follow


def test_never_started_expired_and_lost_sequences_are_told_apart() -> None:
    queue = SequenceQueue(policy(idle_s=0.5, instances=1))
    with pytest.raises(errors.ServiceError) as never:
        queue.push(step(1, 0.0), 0.0)
    assert never.value.code == grpc.StatusCode.NOT_FOUND
    assert "sequence_start flag" in never.value.message
    queue.push(step(2, 0.0, start=True), 0.0)
    queue.push(step(3, 0.0, start=True), 0.0)
    first = queue.next_batch(0.0, [True])
    assert isinstance(first, tuple)
    for item in first[1]:
        queue.finish(item, 0.0, {"s": b""}, 1)
    assert queue.next_expiry() == 0.5
    assert queue.expire(0.4) == ([], 0)
    waiting = step(3, 0.45)
    queue.push(waiting, 0.45)  # 3 is busy again: it does not expire
    assert queue.expire(0.6) == ([], 1)  # 2 expired
    with pytest.raises(errors.ServiceError) as expired:
        queue.push(step(2, 0.7), 0.7)
    assert "expired after 0.5 s" in expired.value.message
    steps, lost = queue.lose(0, "lost its state when its worker was killed by signal 9")
    assert (steps, lost) == ([waiting], 1)
    with pytest.raises(errors.ServiceError) as gone:
        queue.push(step(3, 0.8), 0.8)
    assert gone.value.code == grpc.StatusCode.UNAVAILABLE
    assert "killed by signal 9" in gone.value.message and "sequence_start" in gone.value.message


def test_ended_ids_are_remembered_up_to_a_bound() -> None:
    queue = SequenceQueue(policy(True, max_candidates=ENDED_REMEMBERED + 1))
    for corrid in range(ENDED_REMEMBERED + 1):
        first = step(corrid + 1, 0.0, start=True)
        queue.push(first, 0.0)
        queue.remove(first)  # its caller went away: the sequence is idle
    assert queue.expire(10.0) == ([], ENDED_REMEMBERED + 1)
    with pytest.raises(errors.ServiceError) as forgotten:
        queue.push(step(1, 11.0), 11.0)
    assert "sequence_start flag" in forgotten.value.message  # the oldest was forgotten
    with pytest.raises(errors.ServiceError) as remembered:
        queue.push(step(2, 11.0), 11.0)
    assert "expired" in remembered.value.message


def test_one_sequence_cannot_queue_without_bound() -> None:
    queue = SequenceQueue(policy())
    queue.push(step(1, 0.0, start=True), 0.0)
    for _ in range(MAX_WAITING_PER_SEQUENCE - 1):
        queue.push(step(1, 0.0), 0.0)
    with pytest.raises(errors.ServiceError) as full:
        queue.push(step(1, 0.0), 0.0)
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_oldest_waits_for_a_preferred_batch_until_its_delay() -> None:
    queue = SequenceQueue(policy(True, instances=1, preferred_sizes=(3,), max_queue_delay_s=0.01))
    for corrid in (1, 2):
        queue.push(step(corrid, 0.0, start=True), 0.0)
    assert queue.next_batch(0.0, [True]) == 0.01
    queue.push(step(3, 0.001, start=True), 0.001)
    action = queue.next_batch(0.002, [True])
    assert isinstance(action, tuple) and [s.corrid for s in action[1]] == [1, 2, 3]
    queue.push(step(4, 0.003, start=True), 0.003)
    assert queue.next_batch(0.004, [True]) == pytest.approx(0.013)
    late = queue.next_batch(0.014, [True])
    assert isinstance(late, tuple) and [s.corrid for s in late[1]] == [4]


def test_direct_waits_for_minimum_slot_utilization_until_its_delay() -> None:
    queue = SequenceQueue(
        policy(
            instances=1,
            max_batch_size=4,
            minimum_slot_utilization=0.5,
            max_queue_delay_s=0.01,
        )
    )
    queue.push(step(1, 0.0, start=True), 0.0)
    assert queue.next_batch(0.0, [True]) == 0.01
    queue.push(step(2, 0.001, start=True), 0.001)
    action = queue.next_batch(0.001, [True])
    assert isinstance(action, tuple) and len(action[1]) == 2
