"""The /metrics listener's bounds: the decision (which connections it holds, until when) with
explicit times, swept by hypothesis; and the listener itself on a real socket, where peers that
connect and send nothing hold at most the bound's threads, for at most its time."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.observability.exposition import MetricsServer, serve
from service.observability.scrape_bounds import ScrapeConnections, ScrapeLimits
from tests.servers import closed_by_peer

# (connection, time) events: a connection accepted, one closed by its thread, the loop looking
_EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["accept", "close", "look"]),
        st.integers(0, 40),
        st.floats(0, 5, allow_nan=False),
    ),
    max_size=80,
)


@given(
    max_connections=st.integers(1, 8),
    timeout_s=st.floats(0.01, 3, allow_nan=False),
    events=_EVENTS,
)
def test_it_holds_at_most_its_bound_each_until_its_time(
    max_connections: int, timeout_s: float, events: list[tuple[str, int, float]]
) -> None:
    held: ScrapeConnections[int] = ScrapeConnections(ScrapeLimits(max_connections, timeout_s))
    deadlines: dict[int, float] = {}  # the model: what it should hold
    now = 0.0
    for kind, connection, step in events:
        now += step
        if kind == "accept" and connection not in deadlines:
            admitted = held.admit(connection, now)
            assert admitted == (len(deadlines) < max_connections)
            if admitted:
                deadlines[connection] = now + timeout_s
        elif kind == "close":
            held.ended(connection)
            deadlines.pop(connection, None)
        else:
            expired = held.expired(now)
            assert sorted(expired) == sorted(c for c, d in deadlines.items() if d <= now)
            for connection in expired:
                del deadlines[connection]
        assert len(held) == len(deadlines) <= max_connections
        assert held.next_deadline() == min(deadlines.values(), default=None)


@pytest.mark.parametrize("limits", [(0, 1.0), (1, 0.0), (1, float("nan"))])
def test_limits_that_hold_nothing_are_refused(limits: tuple[int, float]) -> None:
    with pytest.raises(ValueError):
        ScrapeLimits(*limits)


HELD = 3
TIMEOUT_S = 0.5


@pytest.fixture
def listener() -> Iterator[MetricsServer]:
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"up 1\n"]

    server = serve("127.0.0.1", 0, app, ScrapeLimits(HELD, TIMEOUT_S))
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _connection_threads() -> int:
    """The listener's threads answering a connection (socketserver names none of its own)."""
    return sum(
        1 for t in threading.enumerate() if t.name != "metrics" and "process_request" in t.name
    )


def test_idle_peers_hold_at_most_its_bound_and_only_until_its_time(
    listener: MetricsServer,
) -> None:
    address = ("127.0.0.1", listener.server_port)
    before = _connection_threads()
    with contextlib.ExitStack() as stack:
        idle = []
        for _ in range(HELD * 4):
            connection = stack.enter_context(socket.create_connection(address))
            connection.sendall(b"GET /metr")  # a request line that never ends
            idle.append(connection)
        # Those past the bound are closed as they are accepted, the held ones kept.
        closed = [closed_by_peer(c, TIMEOUT_S / 5) for c in idle]
        assert closed.count(False) <= HELD
        assert _connection_threads() - before <= HELD
        # Every one is closed by the server by its time, and its thread ends.
        assert all(closed_by_peer(c, 10.0) for c in idle)
    deadline = time.monotonic() + 10.0
    while _connection_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _connection_threads() == before
    # A scrape is answered once they are gone.
    url = f"http://127.0.0.1:{listener.server_port}/metrics"
    assert urllib.request.urlopen(url, timeout=10).read() == b"up 1\n"


def test_a_scrape_is_answered_while_fewer_than_its_bound_are_idle(
    listener: MetricsServer,
) -> None:
    url = f"http://127.0.0.1:{listener.server_port}/metrics"
    with socket.create_connection(("127.0.0.1", listener.server_port)) as idle:
        idle.sendall(b"GET /metr")
        for _ in range(5):
            assert urllib.request.urlopen(url, timeout=10).read() == b"up 1\n"
