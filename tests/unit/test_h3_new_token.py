"""NEW_TOKEN between a real HTTP/3 server (in this process, so its clock is injected) and real
QuicChannel clients under Retry always: which tokens spare the Retry, and that no token makes
the server refuse a client. The server's own counters tell a Retry sent."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from clients.quic_channel import QuicChannel
from clients.tickets import SessionTicketCache
from transport.h3.address_tokens import ADDRESS_TOKEN_TAG, KEY_BYTES, AddressTokens
from transport.h3.admission import H3Limits, RetryMode
from transport.h3.server import H3Server
from transport.tls.certs import DevCertificates, ensure_dev_certificates
from transport.tls.session_tickets import MemoryTicketStore

LIFETIME_S = 600.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def certs(certs_dir: Path) -> DevCertificates:
    return ensure_dev_certificates(certs_dir)[0]


@dataclass
class Served:
    server: H3Server
    port: int

    @property
    def handshakes(self) -> dict[str, int]:
        return self.server.stats.handshakes

    @property
    def retries(self) -> int:
        return self.server.stats.refusals.get("retry", 0)


@contextlib.asynccontextmanager
async def serving(certs: DevCertificates, tokens: AddressTokens) -> AsyncIterator[Served]:
    server = H3Server(
        tickets=MemoryTicketStore(ttl_s=LIFETIME_S),
        limits=H3Limits(retry=RetryMode.ALWAYS),
        address_tokens=tokens,
    )
    port = await server.start("127.0.0.1", 0, certs.server_cert, certs.server_key)
    try:
        yield Served(server, port)
    finally:
        await server.stop(None)


async def connect(server: Served, certs: DevCertificates, cache: SessionTicketCache) -> None:
    """One connection to `server` that completes its handshake, then closes."""
    async with QuicChannel(
        f"localhost:{server.port}", ca_file=str(certs.ca_cert), ticket_cache=cache
    ) as channel:
        await channel.channel_ready()


def cache_key(server: Served) -> str:
    return SessionTicketCache.key("localhost", "localhost", server.port)


async def test_a_returning_client_skips_the_retry(certs: DevCertificates) -> None:
    async with serving(certs, AddressTokens(os.urandom(KEY_BYTES), LIFETIME_S)) as server:
        cache = SessionTicketCache()
        await connect(server, certs, cache)
        assert server.retries == 1
        for _ in range(2):
            await connect(server, certs, cache)
        assert server.retries == 1
        assert server.handshakes["new_token_valid"] == 2
        assert server.handshakes["new_token_issued"] >= 3


async def test_an_expired_token_gets_a_retry(certs: DevCertificates) -> None:
    clock = Clock()
    async with serving(certs, AddressTokens(os.urandom(KEY_BYTES), LIFETIME_S, clock)) as server:
        cache = SessionTicketCache()
        await connect(server, certs, cache)
        clock.now += LIFETIME_S
        await connect(server, certs, cache)
        assert server.retries == 2
        assert server.handshakes["new_token_expired"] == 1
        # The connection after it got a fresh token, within its lifetime.
        clock.now += LIFETIME_S - 1
        await connect(server, certs, cache)
        assert server.retries == 2


async def test_a_token_of_a_server_with_another_key_gets_a_retry(certs: DevCertificates) -> None:
    clock = Clock()
    async with (
        serving(certs, AddressTokens(os.urandom(KEY_BYTES), LIFETIME_S, clock)) as first,
        serving(certs, AddressTokens(os.urandom(KEY_BYTES), LIFETIME_S, clock)) as other,
    ):
        cache = SessionTicketCache()
        await connect(first, certs, cache)
        cache.add_token(cache_key(other), cache.take_token(cache_key(first)))
        await connect(other, certs, cache)
        assert other.retries == 1
        assert other.handshakes["new_token_unreadable"] == 1


@pytest.mark.parametrize(
    "token",
    [b"\x00", b"x" * 200, ADDRESS_TOKEN_TAG, ADDRESS_TOKEN_TAG + os.urandom(40)],
    ids=["one byte", "long", "tag alone", "tag and noise"],
)
async def test_a_garbage_token_gets_a_retry_and_the_client_is_served(
    certs: DevCertificates, token: bytes
) -> None:
    async with serving(certs, AddressTokens(os.urandom(KEY_BYTES), LIFETIME_S)) as server:
        cache = SessionTicketCache()
        cache.add_token(cache_key(server), token)
        await connect(server, certs, cache)
        assert server.retries == 1
        assert server.handshakes["new_token_unreadable"] == 1
        assert server.handshakes["full"] == 1
