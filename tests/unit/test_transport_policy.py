"""The alt-svc header's syntax and the auto:// transport policy's decisions, with explicit
times."""

from __future__ import annotations

import pytest

from clients.transport_policy import MAX_REMEMBERED_S, TransportPolicy
from transport.grpc.alt_svc import DEFAULT_MAX_AGE_S, Alternative, h3_header, parse_h3


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (h3_header(8443, 600), Alternative("", 8443, 600)),
        ('h3=":443"', Alternative("", 443, DEFAULT_MAX_AGE_S)),
        (
            'h3-29=":1"; ma=5, h3="edge.example:8443"; ma=60; persist=1',
            Alternative("edge.example", 8443, 60),
        ),
        ('h3="[::1]:9000"; ma="30"', Alternative("::1", 9000, 30)),
        ('h2=":443"; ma=60', None),
        ("clear", None),
        ('h3=":99999"', None),
        ("garbage", None),
    ],
)
def test_parse_h3(value: str, expected: Alternative | None) -> None:
    assert parse_h3(value) == expected


def test_http2_until_http3_is_advertised_then_http3_until_it_expires() -> None:
    clock = Clock()
    policy = TransportPolicy(clock)
    assert policy.h3_endpoint("origin") is None
    policy.learn(h3_header(9001, 60))
    assert policy.h3_endpoint("origin") == ("origin", 9001)
    clock.now += 59.9
    assert policy.h3_endpoint("origin") == ("origin", 9001)
    clock.now += 0.1
    assert policy.h3_endpoint("origin") is None


def test_a_new_header_replaces_what_was_known() -> None:
    clock = Clock()
    policy = TransportPolicy(clock)
    policy.learn('h3="other:9002"; ma=60')
    assert policy.h3_endpoint("origin") == ("other", 9002)
    policy.learn("clear")
    assert policy.h3_endpoint("origin") is None
    policy.learn(h3_header(9001, 60))
    policy.learn('h2=":9003"')  # no HTTP/3 offered any more
    assert policy.h3_endpoint("origin") is None


def test_a_failure_is_remembered_for_the_advertised_lifetime() -> None:
    clock = Clock()
    policy = TransportPolicy(clock)
    policy.learn(h3_header(9001, 30))
    policy.h3_failed()
    assert policy.blocked_until == 130.0
    clock.now += 10
    policy.learn(h3_header(9001, 30))  # HTTP/2 responses go on advertising it meanwhile
    assert policy.h3_endpoint("origin") is None
    clock.now += 20
    assert policy.blocked_until is None
    assert policy.h3_endpoint("origin") == ("origin", 9001)


def test_success_forgets_a_failure() -> None:
    clock = Clock()
    policy = TransportPolicy(clock)
    policy.learn(h3_header(9001, 30))
    policy.h3_failed()
    policy.h3_worked()
    assert policy.h3_endpoint("origin") == ("origin", 9001)


def test_lifetimes_are_bounded() -> None:
    clock = Clock()
    policy = TransportPolicy(clock)
    policy.learn(h3_header(9001, 10**9))
    policy.h3_failed()
    assert policy.blocked_until == 100.0 + MAX_REMEMBERED_S
