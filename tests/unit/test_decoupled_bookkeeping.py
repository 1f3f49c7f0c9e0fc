"""A decoupled model's server-side bookkeeping without worker processes: the wait line of its
places (batching/concurrency.py), a request's responses between the worker and its caller
(workers/streams.py), on an event loop with a virtual clock (deadlines and the response-gap
bound fire after everything that could run first, however slow the machine)."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
from google.protobuf import text_format
from hypothesis import given, settings
from hypothesis import strategies as st

from oip.datatypes import BY_NAME
from protos.inference import model_config_pb2 as mc
from service.batching.concurrency import ConcurrencyLimit, LineFull, WaitLine
from service.inference import errors
from service.inference.errors import WorkerDied
from service.inference.jobs import InferJob
from service.model.decoupled import refusal
from service.resilience.fallback import incompatibility
from service.workers import protocol
from service.workers.results import Outputs
from service.workers.streams import CreditExceeded, ResponseLine, StreamRequest, Streams
from tests.virtual_time import VirtualTimePolicy

WINDOW = protocol.RESPONSE_WINDOW
CLIENT = "address 127.0.0.1"


@pytest.fixture(scope="module")
def event_loop_policy() -> asyncio.AbstractEventLoopPolicy:
    return VirtualTimePolicy()


# ---- the wait line: a model of it, and every sequence of arrivals, departures and ends of
# requests of a few clients ----

operations = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "leave", "finish"]), st.integers(0, 30), st.integers(0, 3)
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(limit=st.integers(1, 4), queued=st.integers(0, 4), ops=operations)
def test_wait_line_runs_at_most_limit_and_hands_places_to_the_client_holding_fewest(
    limit: int, queued: int, ops: list[tuple[str, int, int]]
) -> None:
    line: WaitLine[int] = WaitLine(limit, queued)
    held: Counter[int] = Counter()  # places each client holds
    tickets = iter(range(10_000))
    waiting: list[tuple[int, int]] = []  # (ticket, client), arrival order
    for op, pick, client in ops:
        running = sum(held.values())
        if op == "arrive":
            ticket = next(tickets)
            full = running == limit and len(waiting) == queued
            counts = Counter(c for _, c in waiting)
            most = max(counts.values(), default=0)
            if full and counts[client] + 1 >= most:
                with pytest.raises(LineFull):  # its client has its share of the line
                    line.arrive(ticket, client)
                continue
            runs, displaced = line.arrive(ticket, client)
            if runs:
                assert running < limit and not waiting  # nobody is overtaken
                held[client] += 1
                continue
            if full:
                # The newest waiter of a client with the most waiting gives its place up.
                assert displaced is not None
                victim = next(c for t, c in waiting if t == displaced)
                assert counts[victim] == most and victim != client
                assert displaced == max(t for t, c in waiting if c == victim)
                waiting.remove((displaced, victim))
            else:
                assert displaced is None
            waiting.append((ticket, client))
        elif op == "leave" and waiting:
            line.leave(waiting.pop(pick % len(waiting))[0])
        elif op == "finish" and running:
            ending = sorted(held)[pick % len(held)]
            held[ending] -= 1
            held += Counter()  # drop clients that hold none
            started = line.finish(ending)
            if not waiting:
                assert started is None
            else:
                assert started is not None
                ticket, chosen = started
                assert isinstance(chosen, int)
                index = waiting.index((ticket, chosen))
                # Fair: no waiting client holds fewer places than the chosen one, and of
                # those that hold as many, none arrived earlier.
                assert all(held[c] > held[chosen] for _, c in waiting[:index])
                assert all(held[c] >= held[chosen] for _, c in waiting)
                waiting.pop(index)
                held[chosen] += 1
        assert line.running == sum(held.values()) <= limit
        assert line.held == held
        assert line.waiting == len(waiting) <= queued


def test_a_client_over_its_share_gains_no_place_while_another_waits() -> None:
    """One client took every place before anyone else came (many connections from one
    address are one client): as its requests end, the places go to the other client until
    both hold as many."""
    line: WaitLine[str] = WaitLine(4, 16)
    for index in range(4):
        assert line.arrive(f"a{index}", "address 10.0.0.1") == (True, None)
    for index in range(4, 8):
        assert line.arrive(f"a{index}", "address 10.0.0.1") == (False, None)
    for index in range(3):
        assert line.arrive(f"b{index}", "certificate bob") == (False, None)
    started = [line.finish("address 10.0.0.1") for _ in range(3)]
    assert [ticket for ticket, _ in filter(None, started)] == ["b0", "b1", "a4"]
    assert line.held == {"address 10.0.0.1": 2, "certificate bob": 2}
    # Even: whoever's request ends, the client holding fewer gets the place.
    assert line.finish("certificate bob") == ("b2", "certificate bob")
    assert line.finish("address 10.0.0.1") == ("a5", "address 10.0.0.1")
    assert line.held == {"address 10.0.0.1": 2, "certificate bob": 2}


async def test_a_client_that_filled_the_waiting_line_gives_up_its_newest_places_in_it() -> None:
    line: WaitLine[str] = WaitLine(1, 4)
    assert line.arrive("a0", "address 10.0.0.1") == (True, None)
    for index in range(1, 5):
        assert line.arrive(f"a{index}", "address 10.0.0.1") == (False, None)
    with pytest.raises(LineFull):
        line.arrive("a5", "address 10.0.0.1")
    assert line.arrive("b0", "address 10.0.0.2") == (False, "a4")
    assert line.arrive("b1", "address 10.0.0.2") == (False, "a3")
    with pytest.raises(LineFull):  # two each: even
        line.arrive("b2", "address 10.0.0.2")
    # Both hold no place then: the older waiter runs.
    assert line.finish("address 10.0.0.1") == ("a1", "address 10.0.0.1")


async def test_a_cancelled_waiter_leaves_the_line_at_once() -> None:
    limit = ConcurrencyLimit(1, 2, "model 'm' version 1")
    holder_in, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with limit.held(None, CLIENT):
            holder_in.set()
            await release.wait()

    holder = asyncio.create_task(hold())
    await holder_in.wait()
    waiter = asyncio.create_task(hold())
    await asyncio.sleep(0)
    assert (limit.queued, limit.in_flight_requests) == (1, 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert limit.queued == 0  # before the holder ended
    release.set()
    await holder
    assert (limit.queued, limit.in_flight_requests) == (0, 0)


async def test_the_line_refuses_beyond_its_queue_naming_the_parameters() -> None:
    limit = ConcurrencyLimit(1, 1, "model 'm' version 1")
    release = asyncio.Event()

    async def hold() -> None:
        async with limit.held(None, CLIENT):
            await release.wait()

    tasks = [asyncio.create_task(hold()) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(errors.ServiceError) as refused:
        async with limit.held(None, CLIENT):
            pass
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_concurrent_requests" in refused.value.message
    assert "max_queued_requests" in refused.value.message
    release.set()
    await asyncio.gather(*tasks)


async def test_a_displaced_waiter_is_refused_naming_the_shared_line() -> None:
    limit = ConcurrencyLimit(1, 2, "model 'm' version 1")
    release = asyncio.Event()

    async def hold(client: str) -> None:
        async with limit.held(None, client):
            await release.wait()

    crowd = []
    for _ in range(3):  # one runs, two wait: the line is full
        crowd.append(asyncio.create_task(hold("address 10.0.0.1")))
        await asyncio.sleep(0)
    other = asyncio.create_task(hold("address 10.0.0.2"))
    with pytest.raises(errors.ServiceError) as refused:
        await crowd[2]  # the newest of the client with the most waiting
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queued_requests" in refused.value.message
    assert "shared between clients" in refused.value.message
    release.set()
    await asyncio.gather(*crowd[:2], other)
    assert (limit.queued, limit.in_flight_requests) == (0, 0)


async def test_a_waiters_deadline_passes_and_its_place_goes_to_the_next() -> None:
    loop = asyncio.get_running_loop()
    limit = ConcurrencyLimit(1, 2, "model 'm' version 1")
    release, order = asyncio.Event(), []

    async def hold(name: str, deadline: float | None) -> None:
        async with limit.held(deadline, CLIENT):
            order.append(name)
            await release.wait()

    first = asyncio.create_task(hold("first", None))
    await asyncio.sleep(0)
    late = asyncio.create_task(hold("late", loop.time() + 10))
    patient = asyncio.create_task(hold("patient", None))
    with pytest.raises(errors.ServiceError) as expired:
        await late
    assert expired.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    release.set()
    await asyncio.gather(first, patient)
    assert order == ["first", "patient"]
    assert (limit.queued, limit.in_flight_requests) == (0, 0)


# ---- a request's responses ----


def response(final: bool = False, request_id: int = 1) -> protocol.Response:
    data = (7).to_bytes(4, "little")
    return protocol.Response(
        request_id, (protocol.TensorRef("index", "<i4", (1,), 0, 4),), data, final
    )


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(taken=st.integers(0, 3 * WINDOW), extra=st.integers(1, 3))
def test_a_worker_beyond_its_credit_breaks_the_protocol(taken: int, extra: int) -> None:
    line = ResponseLine()
    credited = 0
    for _ in range(taken):
        line.push(response())
        taken_response, credit = line.take()
        assert taken_response is not None
        credited += credit
    for _ in range(WINDOW - (taken - credited)):
        line.push(response())
    with pytest.raises(CreditExceeded):
        for _ in range(extra):
            line.push(response())
    line.push(response(final=True))  # a final needs no credit
    with pytest.raises(CreditExceeded):
        line.push(response())  # nothing after the final one


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(steps=st.lists(st.sampled_from(["send", "take", "credit arrives"]), max_size=80))
def test_credit_goes_back_in_batches_yet_a_waiting_caller_never_stalls_the_worker(
    steps: list[str],
) -> None:
    """A worker that sends while it has credit, a caller that takes, credit that reaches the
    worker late: the worker is never refused (CreditExceeded) for what its credit allowed,
    fewer Credits go back than responses are taken, and whenever the caller has nothing to
    take, the worker has credit to send (neither waits for the other)."""
    line = ResponseLine()
    uncredited = 0  # the worker's: sent, not credited yet
    in_flight: list[int] = []  # credits on their way to the worker
    credits = taken = 0
    for step in steps:
        if step == "send" and uncredited < WINDOW:
            line.push(response())
            uncredited += 1
        elif step == "take":
            taken_response, due = line.take()
            if taken_response is None:  # the caller waits: the worker must have credit
                assert uncredited - sum(in_flight) < WINDOW
                continue
            taken += 1
            if due:
                in_flight.append(due)
                credits += 1
        elif step == "credit arrives" and in_flight:
            uncredited -= in_flight.pop(0)
        assert 0 <= line.credit.owed < WINDOW // 2
    assert credits <= taken // (WINDOW // 2)


class Worker:
    """What a StreamRequest sends its worker, and the requests it forgot."""

    def __init__(self) -> None:
        self.sent: list[protocol.Message] = []
        self.forgotten: list[int] = []

    def request(self) -> StreamRequest:
        outputs = Outputs()
        outputs.declare({"index": BY_NAME["INT32"]}, {})
        return StreamRequest(1, "m", outputs, self.sent.append, self.forgotten.append)


async def test_responses_taken_are_credited_half_a_window_at_once_and_closing_cancels() -> None:
    worker = Worker()
    request = worker.request()
    half = WINDOW // 2
    for _ in range(half + 1):
        request.deliver(response())
    answers = [await request.next(None, None) for _ in range(half)]
    data = [a.outputs[0].data for a in answers if a is not None]
    assert data == [(7).to_bytes(4, "little")] * half
    assert worker.sent == [protocol.Credit(1, half)]
    request.close()
    assert worker.sent[-1] == protocol.Cancel(1) and worker.forgotten == [1]


async def test_a_finished_request_is_not_cancelled_nor_credited_for_its_final() -> None:
    worker = Worker()
    request = worker.request()
    request.deliver(response(final=True))
    answer = await request.next(None, None)
    assert answer is not None and answer.final
    assert await request.next(None, None) is None
    request.close()
    assert worker.sent == []


async def test_worker_death_before_a_response_is_retryable_after_one_it_counts() -> None:
    first = Worker().request()
    first.died("was killed by signal 9")
    with pytest.raises(WorkerDied):
        await first.next(None, None)

    second = Worker().request()
    for _ in range(2):
        second.deliver(response())
    second.died("was killed by signal 9")
    assert await second.next(None, None) is not None  # what came before the death is delivered
    assert await second.next(None, None) is not None
    with pytest.raises(errors.ServiceError) as lost:
        await second.next(None, None)
    assert not isinstance(lost.value, WorkerDied)
    assert lost.value.code is grpc.StatusCode.UNAVAILABLE
    assert "after 2 response(s) were delivered" in lost.value.message


async def test_the_gap_between_responses_is_bounded_and_names_the_parameter() -> None:
    request = Worker().request()
    request.deliver(response())
    assert await request.next(None, 30.0) is not None
    with pytest.raises(errors.ServiceError) as gap:
        await request.next(None, 30.0)
    assert gap.value.code is grpc.StatusCode.INTERNAL
    assert "execution_timeout_ms" in gap.value.message


async def test_a_passed_deadline_ends_the_request() -> None:
    request = Worker().request()
    deadline = asyncio.get_running_loop().time() + 5
    with pytest.raises(errors.ServiceError) as late:
        await request.next(deadline, 30.0)
    assert late.value.code is grpc.StatusCode.DEADLINE_EXCEEDED


limits = st.one_of(st.none(), st.integers(1, 4).map(float))


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(deadline_in=limits, gap_s=limits)
def test_the_earlier_limit_ends_the_wait_when_it_passes_with_its_own_status(
    deadline_in: float | None, gap_s: float | None
) -> None:
    """One timer stands for both limits (the deadline, the gap between responses): the wait
    ends exactly when the earlier passes, as DEADLINE_EXCEEDED where the deadline is (or ties
    with) the earlier one, else INTERNAL naming execution_timeout_ms; with neither it waits on."""
    loop = VirtualTimePolicy().new_event_loop()

    async def wait() -> tuple[float, BaseException] | None:
        """When the wait ended (after it began) and how; None: not within 10 s."""
        start = loop.time()
        deadline = None if deadline_in is None else start + deadline_in
        waiting = asyncio.ensure_future(Worker().request().next(deadline, gap_s))
        ended: list[float] = []
        waiting.add_done_callback(lambda _: ended.append(loop.time() - start))
        await asyncio.sleep(10)  # past either limit
        if not waiting.done():
            waiting.cancel()
            return None
        error = waiting.exception()
        assert error is not None
        return ended[0], error

    try:
        outcome = loop.run_until_complete(wait())
    finally:
        loop.close()
    if deadline_in is None and gap_s is None:
        assert outcome is None
        return
    assert outcome is not None
    ended, error = outcome
    assert isinstance(error, errors.ServiceError)
    if gap_s is None or (deadline_in is not None and deadline_in <= gap_s):
        assert (error.code, ended) == (grpc.StatusCode.DEADLINE_EXCEEDED, deadline_in)
    else:
        assert (error.code, ended) == (grpc.StatusCode.INTERNAL, gap_s)
        assert "execution_timeout_ms" in error.message


def test_responses_of_closed_requests_are_counted_then_dropped() -> None:
    counted = []
    streams = Streams(lambda: counted.append(1))
    sent: list[protocol.Message] = []
    outputs = Outputs()
    outputs.declare({"index": BY_NAME["INT32"]}, {})
    job = InferJob((), (), 0)
    request = streams.start(1, "m", outputs, sent.append, job, "caller", "{}")
    assert len(streams) == 1 and isinstance(sent[0], protocol.Submit)
    streams.deliver(response())
    request.close()  # it forgets itself
    streams.deliver(response())  # already cancelled: dropped, but the model did send it
    assert len(counted) == 2 and len(streams) == 0
    assert sent[-1] == protocol.Cancel(1)


# ---- what a decoupled config may say ----


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('backend: "python"', None),
        ("", "a Paddle model cannot be decoupled"),
        ('backend: "python" dynamic_batching { }', "remove dynamic_batching"),
        ('backend: "python" model_warmup [ { name: "w" } ]', "model_warmup"),
        (
            'backend: "python" parameters { key: "fallback_model" value: { string_value: "x" } }',
            "fallback_model",
        ),
    ],
)
def test_decoupled_configs_refused_with_their_reason(text: str, reason: str | None) -> None:
    config = text_format.Parse(
        f"name: 'm' {text} model_transaction_policy {{ decoupled: true }}", mc.ModelConfig()
    )
    found = refusal(config)
    assert (found is None) if reason is None else (found is not None and reason in found)


def test_a_decoupled_model_cannot_stand_in_as_a_fallback() -> None:
    primary = text_format.Parse("name: 'p' max_batch_size: 0", mc.ModelConfig())
    fallback = text_format.Parse(
        "name: 'f' max_batch_size: 0 model_transaction_policy { decoupled: true }",
        mc.ModelConfig(),
    )
    reason = incompatibility(primary, fallback)
    assert reason is not None and "decoupled" in reason


async def test_an_output_the_config_does_not_declare_is_that_responses_error() -> None:
    request = Worker().request()
    ref = protocol.TensorRef("secret", "<i4", (1,), 0, 4)
    stray = protocol.Response(1, (ref,), bytes(4), False)
    request.deliver(stray)
    answer = await request.next(None, None)
    assert answer is not None and answer.outputs == ()
    assert answer.error is not None and "does not declare" in answer.error
