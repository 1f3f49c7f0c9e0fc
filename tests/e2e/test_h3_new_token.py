"""NEW_TOKEN through the real server process under `--h3-retry always`: a returning client's
token spares it the Retry (the server's counters say none was sent), the same token from
another address does not, replicas sharing the ticket key accept each other's, a client keeps
its token in the `--tickets` file, and no token of any size or content gets a client
refused."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from aioquic.quic.packet import QuicErrorCode, QuicPacketType
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.tickets import SessionTicketCache
from tests.e2e.test_h3_admission import HalfOpen, h3_server, refusals, server_live
from tests.e2e.test_zero_rtt import stats
from tests.servers import ServerProcess
from transport.h3.address_tokens import RETRY_TOKEN_TAG


@pytest.fixture(scope="module")
def retry_always(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    with h3_server(tmp_path_factory.mktemp("retry"), certs_dir, ["--h3-retry", "always"]) as server:
        yield server


def counters(server: ServerProcess) -> dict[str, int]:
    """The server's Retry refusals (as "retry") and handshake counters, now."""
    return {"retry": refusals(server).get("retry", 0), **stats(server).h3_handshakes}


def since(server: ServerProcess, before: dict[str, int]) -> dict[str, int]:
    """How much each counter grew since `before`: what the calling test's connections made."""
    return {key: value - before.get(key, 0) for key, value in counters(server).items()}


async def test_a_returning_client_connects_without_a_retry(
    retry_always: ServerProcess, tmp_path: Path, certs_dir: Path
) -> None:
    server = retry_always
    before = counters(server)
    tickets_file = tmp_path / "tickets.json"

    async def connect_once() -> str | None:
        # A new cache each time, read from the file: as separate runs of the CLI.
        channel = await server_live(
            server, certs_dir, ticket_cache=SessionTicketCache(tickets_file)
        )
        await channel.close()
        return channel.last_connect_mode

    modes = [await connect_once() for _ in range(3)]
    assert modes == ["full", "0rtt-accepted", "0rtt-accepted"]
    made = since(server, before)
    assert made["retry"] == 1  # the first connection's only
    assert made["new_token_valid"] == 2


async def test_a_token_replayed_from_another_address_gets_a_retry(
    retry_always: ServerProcess, certs_dir: Path
) -> None:
    server = retry_always
    before = counters(server)
    cache = SessionTicketCache()
    channel = await server_live(server, certs_dir, ticket_cache=cache)
    await channel.close()
    token = cache.take_token(SessionTicketCache.key("localhost", "localhost", server.port))
    assert token

    elsewhere = HalfOpen(server.port, "127.0.0.2", token)
    assert elsewhere.answer()[0] == QuicPacketType.RETRY
    assert since(server, before)["new_token_other_address"] == 1
    # The address it was issued to, from another port (as after a NAT rebinding): no Retry.
    rebound = HalfOpen(server.port, "127.0.0.1", token)
    packet_type, closed = rebound.answer()
    assert packet_type == QuicPacketType.INITIAL and closed is None
    assert since(server, before)["retry"] == 2  # the first connection's and the replay's
    for attempt in (elsewhere, rebound):
        attempt.close()


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=1, max_size=1000).filter(lambda t: not t.startswith(RETRY_TOKEN_TAG)))
def test_any_other_token_gets_a_retry(retry_always: ServerProcess, token: bytes) -> None:
    """Not validated, so answered as an Initial without a token would be: never closed."""
    attempt = HalfOpen(retry_always.port, "127.0.0.1", token)
    try:
        assert attempt.answer() == (QuicPacketType.RETRY, None)
    finally:
        attempt.close()


def test_a_retry_token_that_fails_closes_with_invalid_token(retry_always: ServerProcess) -> None:
    """RFC 9000 section 8.1.3: the client would not follow a second Retry."""
    attempt = HalfOpen(retry_always.port, "127.0.0.1", RETRY_TOKEN_TAG + b"x" * 40)
    try:
        _, closed = attempt.answer()
        assert closed is not None and closed.error_code == QuicErrorCode.INVALID_TOKEN
    finally:
        attempt.close()


async def test_replicas_sharing_the_ticket_key_accept_each_others_tokens(
    retry_always: ServerProcess, tmp_path: Path, certs_dir: Path
) -> None:
    """Two servers given the same --ticket-key-file (memory ticket stores: only the tokens are
    shared) and one without: a token from the first spares the Retry at the second only."""
    key_file = tmp_path / "ticket.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    shared = ["--h3-retry", "always", "--ticket-key-file", str(key_file)]
    stranger = retry_always  # a key of its own
    before = counters(stranger)
    with (
        h3_server(tmp_path / "a", certs_dir, shared) as issuer,
        h3_server(tmp_path / "b", certs_dir, shared) as replica,
    ):
        issued = SessionTicketCache()
        await (await server_live(issuer, certs_dir, ticket_cache=issued)).close()
        token = issued.take_token(SessionTicketCache.key("localhost", "localhost", issuer.port))
        for server in (replica, stranger):
            presenting = SessionTicketCache()
            presenting.add_token(
                SessionTicketCache.key("localhost", "localhost", server.port), token
            )
            await (await server_live(server, certs_dir, ticket_cache=presenting)).close()
        assert refusals(replica).get("retry", 0) == 0
        assert stats(replica).h3_handshakes["new_token_valid"] == 1
        made = since(stranger, before)
        assert made["retry"] == 1
        assert made["new_token_unreadable"] == 1
