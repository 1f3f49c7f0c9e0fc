"""The HTTP/3 client's liveness decision with explicit times (no clock, nothing waits): when
the server's silence asks for a PING, and when it means the server is gone."""

from __future__ import annotations

from transport.h3.client import liveness, next_check_in, probe_every


def test_only_silence_while_calls_are_in_flight_counts() -> None:
    # Nothing heard since t=0, but the first call started at t=100: 0.125 s of silence.
    assert liveness(100.125, 0.0, busy_since=100.0, unresponsive_s=10.0) == ("wait", 0.125)


def test_a_ping_asks_for_an_answer_before_the_connection_is_given_up() -> None:
    assert probe_every(10.0) == 0.25 and probe_every(0.8) == 0.2
    assert liveness(0.24, 0.0, 0.0, unresponsive_s=10.0)[0] == "wait"
    assert liveness(0.25, 0.0, 0.0, unresponsive_s=10.0) == ("ping", 0.25)
    assert liveness(9.99, 0.0, 0.0, unresponsive_s=10.0)[0] == "ping"
    assert liveness(10.0, 0.0, 0.0, unresponsive_s=10.0) == ("give up", 10.0)


def test_any_packet_heard_starts_the_silence_again() -> None:
    assert liveness(20.0, heard_at=19.875, busy_since=0.0, unresponsive_s=10.0) == ("wait", 0.125)
    assert liveness(30.0, heard_at=19.875, busy_since=0.0, unresponsive_s=10.0)[0] == "give up"


def test_the_ping_goes_when_the_silence_reaches_the_probe_interval() -> None:
    """Not a whole interval after the check that found a shorter silence: a client whose
    address changed while its calls wait for their responses is silent toward the server until
    it sends, so each late check would add to its stall."""
    assert next_check_in("wait", silent=0.0, unresponsive_s=10.0) == 0.25
    assert next_check_in("wait", silent=0.2, unresponsive_s=10.0) == 0.25 - 0.2
    assert next_check_in("ping", silent=0.25, unresponsive_s=10.0) == 0.25
