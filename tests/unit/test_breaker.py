"""The circuit breaker's decisions and the fallback compatibility check, with explicit times."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import text_format
from hypothesis import given
from hypothesis import strategies as st

from protos.inference import model_config_pb2 as mc
from service.model.parameters import BreakerPolicy, ParameterError, check_parameters
from service.resilience.breaker import HALF_OPEN_PROBES, BreakerState, CircuitBreaker, Shown, worst
from service.resilience.fallback import incompatibility

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
POLICY = BreakerPolicy(failure_ratio=0.5, min_requests=4, window_s=10.0, open_s=5.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def state(breaker: CircuitBreaker) -> BreakerState:
    """Read afresh each time (mypy would narrow the property between calls)."""
    return breaker.state


def run(breaker: CircuitBreaker, code: grpc.StatusCode | None) -> None:
    admission = breaker.admit()
    assert admission is not None
    breaker.record(admission, code)


def test_opens_only_with_enough_requests_and_failures() -> None:
    clock = Clock()
    breaker = CircuitBreaker(POLICY, clock)
    for _ in range(3):
        run(breaker, UNAVAILABLE)
    assert state(breaker) is BreakerState.CLOSED  # 3 < min_requests
    run(breaker, None)
    assert state(breaker) is BreakerState.OPEN  # 3 of 4 failed
    assert breaker.admit() is None
    assert breaker.retry_in_s() == pytest.approx(5.0)


def test_caller_errors_never_count() -> None:
    breaker = CircuitBreaker(POLICY, Clock())
    for _ in range(20):
        run(breaker, grpc.StatusCode.INVALID_ARGUMENT)
        run(breaker, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert state(breaker) is BreakerState.CLOSED


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED, UNAVAILABLE]
)
def test_server_side_failures_count(code: grpc.StatusCode) -> None:
    breaker = CircuitBreaker(POLICY, Clock())
    for _ in range(4):
        run(breaker, code)
    assert state(breaker) is BreakerState.OPEN


def test_old_outcomes_leave_the_window() -> None:
    clock = Clock()
    breaker = CircuitBreaker(POLICY, clock)
    for _ in range(3):
        run(breaker, UNAVAILABLE)
    clock.now += 11
    for _ in range(3):
        run(breaker, None)
    run(breaker, UNAVAILABLE)
    assert state(breaker) is BreakerState.CLOSED  # 1 of the last 4 failed


def test_half_open_probes_close_on_success_and_reopen_on_failure() -> None:
    clock = Clock()
    breaker = CircuitBreaker(POLICY, clock)
    breaker.trip()
    clock.now += 5
    assert state(breaker) is BreakerState.HALF_OPEN
    probes = [breaker.admit() for _ in range(HALF_OPEN_PROBES)]
    assert all(p is not None and p.probe for p in probes)
    assert breaker.admit() is None  # the probes are all out
    first = probes[0]
    assert first is not None
    breaker.record(first, UNAVAILABLE)
    assert state(breaker) is BreakerState.OPEN
    clock.now += 5
    probe = breaker.admit()
    assert probe is not None and probe.probe
    breaker.record(probe, None)
    assert state(breaker) is BreakerState.CLOSED
    assert breaker.admit() == breaker.admit()  # closed: everything goes through


def config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


PRIMARY = config(
    """name: "big" max_batch_size: 8
    input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
    output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]
    parameters { key: "fallback_model" value: { string_value: "small" } }"""
)


SHOWN = st.tuples(st.sampled_from(BreakerState), st.floats(min_value=0.0, max_value=60.0))


@given(st.lists(SHOWN, max_size=6), st.randoms())
def test_the_worst_of_several_breakers_is_shown(shown: list[Shown], order: Any) -> None:
    """Each process holding calls keeps its own breaker: OPEN if any is open, else HALF_OPEN
    if any is, else CLOSED; the longest wait among those in that state; in any order."""
    state, retry_in_s = worst(shown)
    states = {s for s, _ in shown}
    for expected in (BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED):
        if expected in states or expected is BreakerState.CLOSED:
            assert state is expected
            break
    assert retry_in_s == max((w for s, w in shown if s is state), default=0.0)
    shuffled = list(shown)
    order.shuffle(shuffled)
    assert worst(shuffled) == (state, retry_in_s)


def test_a_fallback_must_take_the_inputs_and_give_the_outputs() -> None:
    same = config(
        """name: "small" max_batch_size: 16
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] },
                 { name: "z" data_type: TYPE_INT64 dims: [ 1 ] } ]"""
    )
    assert incompatibility(PRIMARY, same) is None
    other_dims = mc.ModelConfig()
    other_dims.CopyFrom(same)
    other_dims.output[0].dims[0] = 2
    assert incompatibility(PRIMARY, other_dims) == (
        "declares output 'y' as FP32[2], this model as FP32[3]"
    )
    smaller = mc.ModelConfig()
    smaller.CopyFrom(same)
    smaller.max_batch_size = 4
    assert "batches of at most 4" in (incompatibility(PRIMARY, smaller) or "")
    extra = mc.ModelConfig()
    extra.CopyFrom(same)
    extra.input.add(name="mask", data_type=mc.TYPE_BOOL, dims=[4])
    assert incompatibility(PRIMARY, extra) == (
        "needs input(s) ['mask'] that this model's callers do not send"
    )


def test_breaker_parameters_are_checked() -> None:
    limits = check_parameters(PRIMARY)
    assert limits.fallback_model == "small" and limits.breaker == BreakerPolicy()
    bad = mc.ModelConfig()
    bad.CopyFrom(PRIMARY)
    bad.parameters["breaker_failure_ratio"].string_value = "1.5"
    with pytest.raises(ParameterError, match="breaker_failure_ratio must be within"):
        check_parameters(bad)
    bad.parameters["breaker_failure_ratio"].string_value = "nan"
    with pytest.raises(ParameterError):
        check_parameters(bad)
    del bad.parameters["breaker_failure_ratio"]
    bad.parameters["fallback_model"].string_value = "big"
    with pytest.raises(ParameterError, match="must name another model"):
        check_parameters(bad)
