"""Address validation tokens for NEW_TOKEN frames (RFC 9000 section 8.1.3): a client that
presents one in its Initial has shown, on an earlier connection, that it receives packets at
its IP address, so the server lets it in without a Retry (one round trip less).

A token is the tag byte `N` (Retry tokens start with `R`: the server tells the two apart before
opening either), a nonce and, sealed with AES-256-GCM, the time it was issued and the client's
IP address. The port is left out: a NAT may give the same client another port for its next
connection, while the address the Retry would check is the same. The key is derived from the
ticket key (service/tickets/seal.py), so every replica and every front-end sharing it accepts
the others' tokens.

Whatever fails to open (another key, altered, truncated, not a token at all), was issued to
another address, or is older than the lifetime only means "not validated": the connection is
treated as one without a token (Retry when the server asks for one), never refused for it.
"""

from __future__ import annotations

import ipaddress
import os
import struct
import time
from collections.abc import Callable
from enum import Enum

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

ADDRESS_TOKEN_TAG = b"N"
RETRY_TOKEN_TAG = b"R"
KEY_BYTES = 32
DEFAULT_LIFETIME_S = 86400.0
# Replicas' clocks may disagree by this much: a token issued "in the future" within it is
# still accepted.
CLOCK_SKEW_S = 60.0
_NONCE_BYTES = 12
_TAG_BYTES = 16
_ISSUED = struct.Struct("!Q")  # milliseconds since the epoch
# Tag, nonce, issue time, an IPv6 address, the AEAD tag: 53 bytes. Anything longer is not ours
# and is not decrypted.
MAX_TOKEN_BYTES = len(ADDRESS_TOKEN_TAG) + _NONCE_BYTES + _ISSUED.size + 16 + _TAG_BYTES


class TokenVerdict(Enum):
    VALID = "valid"
    EXPIRED = "expired"  # older than the lifetime, or issued too far in the future
    OTHER_ADDRESS = "other_address"
    UNREADABLE = "unreadable"  # not a token of this key


def packed_address(host: str) -> bytes:
    """The IP address a token is bound to; an IPv4-mapped IPv6 address (a dual-stack socket)
    is the IPv4 address it maps."""
    address = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.packed


class AddressTokens:
    """Issues and checks tokens at the clock's wall-clock time (replicas agree on it)."""

    def __init__(
        self, key: bytes, lifetime_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"an address token key holds {KEY_BYTES} bytes")
        if lifetime_s <= 0:
            raise ValueError("an address token lifetime must be positive")
        self._aead = AESGCM(key)
        self.lifetime_s = lifetime_s
        self._clock = clock

    def issue(self, host: str) -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        plain = _ISSUED.pack(int(self._clock() * 1000)) + packed_address(host)
        return ADDRESS_TOKEN_TAG + nonce + self._aead.encrypt(nonce, plain, ADDRESS_TOKEN_TAG)

    def check(self, token: bytes, host: str) -> TokenVerdict:
        """Never raises, whatever `token` holds."""
        if not token.startswith(ADDRESS_TOKEN_TAG) or len(token) > MAX_TOKEN_BYTES:
            return TokenVerdict.UNREADABLE
        start = len(ADDRESS_TOKEN_TAG)
        nonce, sealed = token[start : start + _NONCE_BYTES], token[start + _NONCE_BYTES :]
        try:
            plain = self._aead.decrypt(nonce, sealed, ADDRESS_TOKEN_TAG)
        except (InvalidTag, ValueError):  # ValueError: a nonce cut short
            return TokenVerdict.UNREADABLE
        if len(plain) < _ISSUED.size:
            return TokenVerdict.UNREADABLE
        age = self._clock() - _ISSUED.unpack_from(plain)[0] / 1000
        if not -CLOCK_SKEW_S <= age < self.lifetime_s:
            return TokenVerdict.EXPIRED
        if plain[_ISSUED.size :] != packed_address(host):
            return TokenVerdict.OTHER_ADDRESS
        return TokenVerdict.VALID
