"""The shared ticket store against a real redis-server: single use and TTL across stores
(processes or replicas), sealing at rest, and an unreachable Redis turning 0-RTT off."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag

from service.tickets.redis_store import RedisTicketStore
from service.tickets.seal import TicketKeyError, TicketSealer, redeem
from service.tickets.store import TicketStoreError, open_address_tokens, open_ticket_store
from tests.redis_server import running_redis
from tests.servers import free_port
from tests.unit.test_tickets import FakeClock, ticket
from transport.h3.address_tokens import TokenVerdict
from transport.tls.session_tickets import TicketCounters

KEY = bytes(range(32))


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "ticket.key"
    path.write_bytes(KEY)
    path.chmod(0o600)
    return path


def replica(redis_url: str, key: bytes = KEY, ttl_s: float = 60.0) -> RedisTicketStore:
    return RedisTicketStore.from_url(redis_url, TicketSealer(key), ttl_s)


def test_sealed_ticket_opens_only_with_its_key_and_label() -> None:
    sealer = TicketSealer(KEY)
    original = ticket(b"label")
    name, sealed = sealer.seal(original, 1234.5)
    assert sealer.open(b"label", sealed) == (original, 1234.5)
    assert name == sealer.name(b"label") != sealer.name(b"other")
    with pytest.raises(InvalidTag):
        TicketSealer(b"k" * 32).open(b"label", sealed)
    with pytest.raises(InvalidTag):
        sealer.open(b"other", sealed)  # moved under another entry's name


def test_short_or_missing_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TicketKeyError, match="at least 32 bytes"):
        TicketSealer(b"short")
    with pytest.raises(TicketKeyError, match="cannot read"):
        TicketSealer.from_file(tmp_path / "missing")


def test_a_ticket_is_redeemed_once_across_replicas(redis_url: str) -> None:
    a, b = replica(redis_url), replica(redis_url)
    shared = ticket(b"shared")
    a.add(shared)
    assert b.pop(b"shared") == shared
    assert a.pop(b"shared") is None
    assert b.pop(b"shared") is None
    assert (a.counters.issued, b.counters.redeemed, a.counters.refused, b.counters.refused) == (
        1,
        1,
        1,
        1,
    )


def test_redis_holds_neither_labels_nor_secrets_and_expires_them(redis_url: str) -> None:
    store = replica(redis_url, ttl_s=30)
    stored = ticket(b"visible-label")
    store.add(stored)
    name = store.sealer.name(b"visible-label")
    raw = store.client.get(name)
    assert isinstance(raw, bytes)
    for secret in (stored.resumption_secret, b"visible-label", stored.ticket.hex().encode()):
        assert secret not in raw
    assert all(b"visible-label" not in key for key in store.client.scan_iter())
    assert 0 < store.client.pttl(name) <= 30_000  # Redis expires it: the TTL holds everywhere


def test_tickets_of_another_key_or_altered_in_redis_are_refused(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    replica(redis_url, key=b"x" * 32).add(ticket(b"foreign"))
    store = replica(redis_url)
    assert store.pop(b"foreign") is None  # another deployment's key names it elsewhere
    store.add(ticket(b"altered"))
    name = store.sealer.name(b"altered")
    sealed = store.client.get(name)
    assert isinstance(sealed, bytes)
    store.client.set(name, sealed[:-1] + bytes([sealed[-1] ^ 1]))
    with caplog.at_level(logging.WARNING):
        assert store.pop(b"altered") is None
    assert "did not open: altered" in caplog.text
    assert store.counters.refused == 2


def test_unreachable_redis_turns_0rtt_off_until_it_answers_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    clock = FakeClock()
    url = f"redis://127.0.0.1:{port}/0"
    store = RedisTicketStore(
        RedisTicketStore.from_url(url, TicketSealer(KEY)).client, TicketSealer(KEY), clock=clock
    )
    with caplog.at_level(logging.WARNING):
        assert store.check() is False
        assert not store.available  # the failed PING starts the back-off
        store.add(ticket(b"lost"))  # nothing stored: that client will do a full handshake
        assert store.pop(b"lost") is None
    assert caplog.text.count("ticket store unreachable") == 1  # warned once per outage
    assert not store.available
    with running_redis(tmp_path / "redis", port):
        assert store.pop(b"any") is None  # still inside the back-off: no network round trip
        assert store.check() is False
        clock.now += store.retry_after_s
        assert store.check() is True
        back = ticket(b"back")
        store.add(back)
        assert store.pop(b"back") == back
    assert store.counters.issued == 1


def test_ticket_store_configuration(tmp_path: Path, key_file: Path, redis_url: str) -> None:
    assert len(open_ticket_store("memory", "", 60)) == 0  # type: ignore[arg-type]
    with pytest.raises(TicketStoreError, match="needs --ticket-key-file"):
        open_ticket_store(redis_url, "", 60)
    with pytest.raises(TicketStoreError, match="expected memory"):
        open_ticket_store("memcached://localhost", str(key_file), 60)
    (tmp_path / "short.key").write_bytes(b"short")
    (tmp_path / "short.key").chmod(0o600)
    with pytest.raises(TicketStoreError, match="at least 32 bytes"):
        open_ticket_store(redis_url, str(tmp_path / "short.key"), 60)
    store = open_ticket_store(redis_url, str(key_file), 60)
    assert isinstance(store, RedisTicketStore) and store.available
    assert store.check() is True


def test_redis_is_only_reached_through_its_short_timeout(redis_url: str) -> None:
    """redis-py's retries would multiply the event loop's blocking: the store turns them off."""
    kwargs = replica(redis_url).client.get_connection_kwargs()
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.05
    retry = replica(redis_url).client.get_retry()
    assert retry is not None and retry.get_retries() == 0


@pytest.mark.parametrize(
    ("mode", "private"),
    [
        (0o600, True),
        (0o400, True),
        (0o440, True),  # Kubernetes' fsGroup makes a 0400 secret this
        (0o644, False),
        (0o604, False),
        (0o602, False),
        (0o620, False),
        (0o660, False),
    ],
    ids=lambda value: f"{value:04o}" if type(value) is int else str(value),
)
def test_a_ticket_key_other_users_can_read_or_replace_is_refused(
    key_file: Path, mode: int, private: bool
) -> None:
    key_file.chmod(mode)
    if private:
        assert TicketSealer.from_file(key_file).name(b"x") == TicketSealer(KEY).name(b"x")
        return
    with pytest.raises(TicketKeyError, match=f"mode {mode:04o}.*chmod 600 {key_file}"):
        TicketSealer.from_file(key_file)


def test_the_expiry_is_sealed_so_a_raised_ttl_or_a_ticket_put_back_ends_with_it(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Whoever can write to Redis can put a redeemed ticket back: it opens again, but only
    until the expiry it was issued with, whatever TTL Redis gives it."""
    wall = FakeClock()
    store = RedisTicketStore(replica(redis_url).client, TicketSealer(KEY), 60, wall_clock=wall)
    kept = ticket(b"put-back")
    store.add(kept)
    name = store.sealer.name(b"put-back")
    sealed = store.client.get(name)
    assert isinstance(sealed, bytes)
    assert store.pop(b"put-back") == kept
    store.client.set(name, sealed)  # put back, with no TTL at all
    assert store.pop(b"put-back") == kept  # within its sealed expiry: it works again
    store.client.set(name, sealed)
    wall.now += 60
    with caplog.at_level(logging.WARNING):
        assert store.pop(b"put-back") is None
    assert "outlived its sealed expiry" in caplog.text
    assert (store.counters.redeemed, store.counters.refused) == (2, 1)


def test_an_entry_sealed_without_an_expiry_is_refused() -> None:
    """What an earlier version sealed (the same fields, no expiry) is refused, not raised."""
    sealer = TicketSealer(KEY)
    name, sealed = sealer.seal(ticket(b"old"), time.time() + 3600)
    fields = json.loads(sealer._aead.decrypt(sealed[:12], sealed[12:], name))
    del fields["expires"]
    nonce = os.urandom(12)
    old = nonce + sealer._aead.encrypt(nonce, json.dumps(fields).encode(), name)
    counters = TicketCounters()
    assert redeem(sealer, b"old", old, time.time(), counters) is None
    assert counters.refused == 1


def test_servers_sharing_the_ticket_key_accept_each_others_address_tokens(
    key_file: Path, tmp_path: Path
) -> None:
    """Replicas and front-ends given the same --ticket-key-file; a server without one, or
    with another, does not accept them."""
    first, second = (open_address_tokens(str(key_file), 60) for _ in range(2))
    assert first is not None and second is not None
    token = first.issue("198.51.100.7")
    assert second.check(token, "198.51.100.7") is TokenVerdict.VALID
    other_file = tmp_path / "other.key"
    other_file.write_bytes(bytes(reversed(KEY)))
    other_file.chmod(0o600)
    for stranger in (open_address_tokens("", 60), open_address_tokens(str(other_file), 60)):
        assert stranger is not None
        assert stranger.check(token, "198.51.100.7") is TokenVerdict.UNREADABLE
    assert open_address_tokens(str(key_file), 0) is None  # --h3-token-lifetime 0: none sent
    key_file.chmod(0o666)
    with pytest.raises(TicketStoreError, match="chmod 600"):
        open_address_tokens(str(key_file), 60)
    other_file.write_bytes(b"short")
    with pytest.raises(TicketStoreError, match="at least 32 bytes"):
        open_address_tokens(str(other_file), 60)


@pytest.mark.parametrize("call", ["add", "pop"])
def test_an_outage_starts_and_ends_with_any_call(
    call: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not only the PING at start: an add or a pop that fails turns the store off for
    `retry_after_s` (5 s, as docs/http3.md says; warned once), a failed pop and every pop
    meanwhile count as refused, and the first call that succeeds after it ends the outage
    (warned)."""
    clock = FakeClock()
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    store = RedisTicketStore(
        RedisTicketStore.from_url(url, TicketSealer(KEY)).client, TicketSealer(KEY), clock=clock
    )
    assert store.retry_after_s == 5.0

    def run() -> None:
        if call == "add":
            store.add(ticket(b"t"))
        else:
            assert store.pop(b"t") is None

    with caplog.at_level(logging.WARNING):
        run()
        assert not store.available
        assert store.pop(b"t") is None
    assert caplog.text.count("ticket store unreachable") == 1
    assert (store.counters.issued, store.counters.refused) == (0, 1 + (call == "pop"))
    with running_redis(tmp_path / "redis", port):
        clock.now += store.retry_after_s
        with caplog.at_level(logging.WARNING):
            run()
        assert store.available
    assert "ticket store reachable again" in caplog.text
    assert store.counters.issued == (call == "add")


def test_the_sealed_expiry_is_the_ttl_redis_keeps_the_entry_for(redis_url: str) -> None:
    wall = FakeClock()
    store = RedisTicketStore(replica(redis_url).client, TicketSealer(KEY), 30, wall_clock=wall)
    stored = ticket(b"timed")
    store.add(stored)
    name = store.sealer.name(b"timed")
    raw = store.client.get(name)
    assert isinstance(raw, bytes)
    assert store.sealer.open(b"timed", raw) == (stored, wall.now + 30)
    assert 0 < store.client.pttl(name) <= 30_000


def test_a_ttl_under_a_millisecond_still_stores_the_ticket(redis_url: str) -> None:
    """Redis refuses an expiry of 0 ms: the store asks for 1 ms instead of failing."""
    store = RedisTicketStore(replica(redis_url).client, TicketSealer(KEY), 0.0001)
    store.add(ticket(b"brief"))
    assert store.available and store.counters.issued == 1
    assert store.ttl_ms == 1
