"""The decision on each new HTTP/3 connection (transport/h3/admission.py), alone and with a
second process on the port: through any sequence of connections opened, handshakes finished
and connections closed, every decision is the one the limits and both processes' counts call
for, and together the processes never hold more than the limits."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from transport.h3.admission import COLUMNS, COUNTERS, ConnectionAdmission, H3Limits, RetryMode
from transport.h3.aioquic.quic_server import Admission
from transport.host_tally import HostTally, ScopedTally, TallyLayout, create, slots_for

ADDRESSES = ("10.0.0.1", "10.0.0.2", "::1")
LIMITS = st.builds(
    H3Limits,
    max_connections=st.integers(1, 6),
    max_connections_per_address=st.integers(1, 4),
    retry=st.sampled_from(RetryMode),
    retry_above_half_open=st.integers(1, 4),
)
STEPS = st.lists(
    st.tuples(
        st.sampled_from(("open", "finish", "close")),
        st.integers(0, 1),  # which process
        st.integers(0, len(ADDRESSES) - 1),  # the address it opens from
        st.booleans(),  # validated (open) / which of its connections (finish, close)
    ),
    max_size=60,
)


@dataclass
class Process:
    admission: ConnectionAdmission
    refusals: Counter[str] = field(default_factory=Counter)
    open: list[tuple[str, bool]] = field(default_factory=list)  # (address, finished)


def counted(limits: H3Limits, host: ScopedTally | None) -> Process:
    refusals: Counter[str] = Counter()
    return Process(
        ConnectionAdmission(limits, host, lambda kind: refusals.update([kind])), refusals
    )


def expected(
    limits: H3Limits, processes: list[Process], address: str, validated: bool
) -> Admission:
    held = [c for p in processes for c in p.open]
    if len(held) >= limits.max_connections:
        return Admission.REFUSE
    if sum(a == address for a, _ in held) >= limits.max_connections_per_address:
        return Admission.REFUSE
    unfinished = sum(not finished for _, finished in held)
    if not validated and (
        limits.retry is RetryMode.ALWAYS
        or (limits.retry is RetryMode.AUTO and unfinished >= limits.retry_above_half_open)
    ):
        return Admission.RETRY
    return Admission.ACCEPT


def run(
    limits: H3Limits, steps: list[tuple[str, int, int, bool]], processes: list[Process]
) -> None:
    for action, index, address_index, flag in steps:
        process = processes[index % len(processes)]
        admission = process.admission
        if action == "open":
            address = ADDRESSES[address_index]
            want = expected(limits, processes, address, flag)
            refused = sum(process.refusals.values())
            assert admission.decide((address, 4433), flag) is want
            assert sum(process.refusals.values()) == refused + (want is not Admission.ACCEPT)
            if want is Admission.ACCEPT:
                assert admission.opened() == address
                process.open.append((address, False))
                admission.publish(address, 0)
        elif process.open:
            slot = len(process.open) - 1 if flag else 0
            address, finished = process.open[slot]
            if action == "finish" and not finished:
                admission.handshake_finished()
                process.open[slot] = (address, True)
                admission.publish("", 0)
            elif action == "close":
                admission.closed(address, unfinished=not finished)
                del process.open[slot]
                admission.publish(address, 0)
        held = [c for p in processes for c in p.open]
        assert len(held) <= limits.max_connections
        assert max(Counter(a for a, _ in held).values(), default=0) <= (
            limits.max_connections_per_address
        )
        assert admission.held == len(process.open)
        assert admission.unfinished == sum(not f for _, f in process.open)
        assert admission.per_address == Counter(a for a, _ in process.open)


@settings(max_examples=150, deadline=None)
@given(limits=LIMITS, steps=STEPS)
def test_one_process_decides_by_its_own_counts(
    limits: H3Limits, steps: list[tuple[str, int, int, bool]]
) -> None:
    run(limits, steps, [counted(limits, None)])


@settings(max_examples=150, deadline=None)
@given(limits=LIMITS, steps=STEPS)
def test_two_processes_on_one_port_decide_by_both_counts(
    limits: H3Limits, steps: list[tuple[str, int, int, bool]]
) -> None:
    layout = TallyLayout(processes=2, counters=COUNTERS, slots=slots_for(8), columns=COLUMNS)
    fd = create(layout)
    tallies = [HostTally(fd, layout, index) for index in range(2)]
    try:
        run(limits, steps, [counted(limits, ScopedTally(tally, 0, 0)) for tally in tallies])
    finally:
        for tally in tallies:
            tally.close()
        os.close(fd)


def test_each_refusal_is_counted_by_its_kind() -> None:
    refusals: Counter[str] = Counter()
    limits = H3Limits(max_connections=2, max_connections_per_address=1, retry=RetryMode.ALWAYS)
    admission = ConnectionAdmission(limits, None, lambda kind: refusals.update([kind]))
    assert admission.decide(("10.0.0.1", 1), False) is Admission.RETRY
    assert admission.decide(("10.0.0.1", 1), True) is Admission.ACCEPT
    admission.opened()
    assert admission.decide(("10.0.0.1", 2), True) is Admission.REFUSE
    assert admission.decide(("10.0.0.2", 1), True) is Admission.ACCEPT
    admission.opened()
    assert admission.decide(("10.0.0.3", 1), True) is Admission.REFUSE
    assert refusals == Counter({"retry": 1, "connections_per_address": 1, "connections": 1})
