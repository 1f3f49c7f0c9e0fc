"""NEW_TOKEN address tokens as a pure policy: explicit addresses and an injected clock decide
what a token proves, and nothing a client sends makes the check raise."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from transport.h3.address_tokens import (
    ADDRESS_TOKEN_TAG,
    CLOCK_SKEW_S,
    KEY_BYTES,
    MAX_TOKEN_BYTES,
    AddressTokens,
    TokenVerdict,
)
from transport.h3.aioquic.quic_server import TaggedRetryTokens

KEY = b"k" * KEY_BYTES
LIFETIME_S = 3600.0
ISSUED_AT = 1_800_000_000.0


class Clock:
    def __init__(self, now: float = ISSUED_AT) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tokens(clock: Clock | None = None, key: bytes = KEY) -> AddressTokens:
    return AddressTokens(key, LIFETIME_S, clock or Clock())


def test_a_token_validates_the_address_it_was_issued_to() -> None:
    policy = tokens()
    assert policy.check(policy.issue("198.51.100.7"), "198.51.100.7") is TokenVerdict.VALID
    assert policy.check(policy.issue("2001:db8::7"), "2001:db8::7") is TokenVerdict.VALID


def test_a_token_replayed_from_another_address_does_not() -> None:
    policy = tokens()
    token = policy.issue("198.51.100.7")
    assert policy.check(token, "198.51.100.8") is TokenVerdict.OTHER_ADDRESS
    assert policy.check(token, "2001:db8::7") is TokenVerdict.OTHER_ADDRESS


def test_an_ipv4_client_seen_through_a_dual_stack_socket_is_the_same_address() -> None:
    policy = tokens()
    assert policy.check(policy.issue("198.51.100.7"), "::ffff:198.51.100.7") is TokenVerdict.VALID
    assert policy.check(policy.issue("::ffff:198.51.100.7"), "198.51.100.7") is TokenVerdict.VALID


def test_a_token_expires_after_its_lifetime() -> None:
    clock = Clock()
    policy = tokens(clock)
    token = policy.issue("198.51.100.7")
    clock.now = ISSUED_AT + LIFETIME_S - 0.01
    assert policy.check(token, "198.51.100.7") is TokenVerdict.VALID
    clock.now = ISSUED_AT + LIFETIME_S
    assert policy.check(token, "198.51.100.7") is TokenVerdict.EXPIRED


def test_a_shorter_lifetime_applies_to_tokens_issued_under_a_longer_one() -> None:
    clock = Clock()
    token = AddressTokens(KEY, 7 * 86400.0, clock).issue("198.51.100.7")
    clock.now = ISSUED_AT + LIFETIME_S + 1
    assert tokens(clock).check(token, "198.51.100.7") is TokenVerdict.EXPIRED


def test_a_token_from_the_future_is_accepted_only_within_the_clock_skew() -> None:
    clock = Clock(ISSUED_AT + CLOCK_SKEW_S)
    token = tokens(clock).issue("198.51.100.7")
    clock.now = ISSUED_AT + 0.01
    assert tokens(clock).check(token, "198.51.100.7") is TokenVerdict.VALID
    clock.now = ISSUED_AT - 0.01
    assert tokens(clock).check(token, "198.51.100.7") is TokenVerdict.EXPIRED


def test_a_token_of_another_key_is_unreadable() -> None:
    token = tokens(key=b"o" * KEY_BYTES).issue("198.51.100.7")
    assert tokens().check(token, "198.51.100.7") is TokenVerdict.UNREADABLE


def test_tokens_are_bounded_and_tagged() -> None:
    token = tokens().issue("2001:db8:ffff:ffff:ffff:ffff:ffff:ffff")
    assert token.startswith(ADDRESS_TOKEN_TAG)
    assert len(token) == MAX_TOKEN_BYTES


def test_retry_tokens_and_address_tokens_are_told_apart() -> None:
    retry = TaggedRetryTokens()
    address = ("198.51.100.7", 4433)
    retry_token = retry.create_token(
        address=address,
        original_destination_connection_id=b"o" * 8,
        retry_source_connection_id=b"r" * 8,
        now=0.0,
    )
    assert tokens().check(retry_token, "198.51.100.7") is TokenVerdict.UNREADABLE
    with pytest.raises(ValueError):
        retry.validate_token(
            address=address, destination_cid=b"r" * 8, token=tokens().issue("198.51.100.7"), now=0
        )
    assert (
        retry.validate_token(address=address, destination_cid=b"r" * 8, token=retry_token, now=0)
        == b"o" * 8
    )


@given(st.binary(max_size=2 * MAX_TOKEN_BYTES))
def test_garbage_never_raises_nor_validates(garbage: bytes) -> None:
    policy = tokens()
    for token in (garbage, ADDRESS_TOKEN_TAG + garbage):
        assert policy.check(token, "198.51.100.7") is not TokenVerdict.VALID


@given(st.integers(min_value=0, max_value=8 * 41 - 1))
def test_any_bit_flipped_makes_a_token_unreadable(bit: int) -> None:
    policy = tokens()
    token = bytearray(policy.issue("198.51.100.7"))
    token[bit // 8] ^= 1 << (bit % 8)
    assert policy.check(bytes(token), "198.51.100.7") is TokenVerdict.UNREADABLE


def test_a_bad_key_or_lifetime_is_refused() -> None:
    with pytest.raises(ValueError):
        AddressTokens(b"short", LIFETIME_S)
    with pytest.raises(ValueError):
        AddressTokens(KEY, 0)
