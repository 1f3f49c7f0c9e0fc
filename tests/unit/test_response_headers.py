"""Which responses carry the server's headers (alt-svc): response_headers.PerConnection."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from transport.grpc.response_headers import PerConnection

REFRESH_S = 60.0


def test_a_connection_is_told_first_then_again_once_the_refresh_passed() -> None:
    schedule = PerConnection(REFRESH_S)
    assert schedule.due("ipv4:10.0.0.1:5000", 0.0)
    assert not schedule.due("ipv4:10.0.0.1:5000", 59.9)
    assert schedule.due("ipv4:10.0.0.2:5000", 59.9)  # another connection
    assert schedule.due("ipv4:10.0.0.1:5000", 60.0)
    assert not schedule.due("ipv4:10.0.0.1:5000", 119.9)


@given(
    calls=st.lists(
        st.tuples(st.integers(0, 20), st.floats(0, 5, allow_nan=False)), min_size=1, max_size=200
    ),
    remembered=st.integers(1, 8),
)
def test_no_connection_goes_longer_than_the_refresh_without_being_told(
    calls: list[tuple[int, float]], remembered: int
) -> None:
    """Whatever the order of calls and however few connections are remembered: every
    connection's first response carries the headers, and no response goes without them more
    than the refresh after the last one that carried them."""
    schedule = PerConnection(3.0, max_connections=remembered)
    told: dict[int, float] = {}
    now = 0.0
    for peer, step in calls:
        now += step
        due = schedule.due(f"ipv4:127.0.0.1:{peer}", now)
        if peer not in told or now - told[peer] >= 3.0:
            assert due
        if due:
            told[peer] = now
    assert len(schedule._sent) <= remembered
