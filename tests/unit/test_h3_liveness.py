"""The HTTP/3 client's liveness decision with explicit times (no clock, nothing waits): when
the server's silence asks for a PING, and when it means the server is gone."""

from __future__ import annotations

from transport.h3.client import liveness, probe_every


def test_only_silence_while_calls_are_in_flight_counts() -> None:
    # Nothing heard since t=0, but the first call started at t=100: 0.5 s of silence.
    assert liveness(100.5, heard_at=0.0, busy_since=100.0, unresponsive_s=10.0) == ("wait", 0.5)


def test_a_ping_asks_for_an_answer_before_the_connection_is_given_up() -> None:
    assert probe_every(10.0) == 1.0 and probe_every(2.0) == 0.5
    assert liveness(0.99, 0.0, 0.0, unresponsive_s=10.0)[0] == "wait"
    assert liveness(1.0, 0.0, 0.0, unresponsive_s=10.0) == ("ping", 1.0)
    assert liveness(9.99, 0.0, 0.0, unresponsive_s=10.0)[0] == "ping"
    assert liveness(10.0, 0.0, 0.0, unresponsive_s=10.0) == ("give up", 10.0)


def test_any_packet_heard_starts_the_silence_again() -> None:
    assert liveness(20.0, heard_at=19.5, busy_since=0.0, unresponsive_s=10.0) == ("wait", 0.5)
    assert liveness(30.0, heard_at=19.5, busy_since=0.0, unresponsive_s=10.0)[0] == "give up"
