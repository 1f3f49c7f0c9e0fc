"""Session tickets: single use, TTL and bounds on the server; at-most-once use and private
persistence on the client."""

from __future__ import annotations

import datetime
import json
import stat
from pathlib import Path

from aioquic.tls import CipherSuite, SessionTicket

from clients.tickets import MAX_TOKEN_BYTES, SessionTicketCache
from transport.tls.session_tickets import MemoryTicketStore


def ticket(label: bytes, server_name: str = "localhost") -> SessionTicket:
    now = datetime.datetime.now(datetime.UTC)
    return SessionTicket(
        age_add=7,
        cipher_suite=CipherSuite.AES_128_GCM_SHA256,
        not_valid_after=now + datetime.timedelta(hours=1),
        not_valid_before=now - datetime.timedelta(seconds=1),
        resumption_secret=b"s" * 32,
        server_name=server_name,
        ticket=label,
        max_early_data_size=0xFFFFFFFF,
        other_extensions=[(57, b"\x01\x02")],
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_server_ticket_is_single_use() -> None:
    store = MemoryTicketStore()
    store.add(ticket(b"a"))
    assert store.pop(b"a") is not None
    assert store.pop(b"a") is None  # a replay finds nothing: full handshake, no early data
    assert (store.counters.redeemed, store.counters.refused) == (1, 1)


def test_server_ticket_expires_after_its_ttl() -> None:
    clock = FakeClock()
    store = MemoryTicketStore(ttl_s=60, clock=clock)
    store.add(ticket(b"a"))
    store.add(ticket(b"b"))
    assert store.pop(b"a") is not None
    clock.now += 61
    assert store.pop(b"b") is None


def test_server_store_is_bounded_and_evicts_the_oldest() -> None:
    store = MemoryTicketStore(max_tickets=2)
    for label in (b"a", b"b", b"c"):
        store.add(ticket(label))
    assert len(store) == 2
    assert store.pop(b"a") is None
    assert store.pop(b"c") is not None
    assert store.counters.evicted == 1


def test_client_uses_a_ticket_at_most_once() -> None:
    cache = SessionTicketCache()
    key = SessionTicketCache.key("localhost", "127.0.0.1", 8001)
    cache.add(key, ticket(b"a"))
    assert cache.take(key) is not None
    assert cache.take(key) is None
    assert cache.take(SessionTicketCache.key("other", "127.0.0.1", 8001)) is None


def test_client_tickets_persist_privately_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "edge" / "tickets.json"
    key = SessionTicketCache.key("localhost", "127.0.0.1", 8001)
    SessionTicketCache(path).add(key, ticket(b"persisted"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    restored = SessionTicketCache(path).take(key)  # a new process would read the same file
    assert restored is not None
    original = ticket(b"persisted")
    for name in ("age_add", "cipher_suite", "resumption_secret", "server_name", "ticket"):
        assert getattr(restored, name) == getattr(original, name)
    assert restored.max_early_data_size == original.max_early_data_size
    assert restored.other_extensions == [(57, b"\x01\x02")]
    assert SessionTicketCache(path).take(key) is None  # taken: gone from the file too


def test_client_ignores_an_unreadable_ticket_file(tmp_path: Path) -> None:
    path = tmp_path / "tickets.json"
    path.write_text("not json")
    assert SessionTicketCache(path).take("x") is None


def test_client_keeps_the_newest_token_and_shows_it_once(tmp_path: Path) -> None:
    path = tmp_path / "tickets.json"
    key = SessionTicketCache.key("localhost", "127.0.0.1", 8001)
    cache = SessionTicketCache(path)
    cache.add(key, ticket(b"t"))
    cache.add_token(key, b"older")
    cache.add_token(key, b"newer")
    cache.add_token(key, b"x" * (MAX_TOKEN_BYTES + 1))  # not kept
    restored = SessionTicketCache(path)  # as the next run of the command line
    assert restored.take_token(key) == b"newer"
    assert restored.take(key) is not None
    assert SessionTicketCache(path).take_token(key) == b""  # taken: gone from the file too


def test_client_reads_a_ticket_file_written_before_tokens(tmp_path: Path) -> None:
    path = tmp_path / "tickets.json"
    key = SessionTicketCache.key("localhost", "127.0.0.1", 8001)
    SessionTicketCache(path).add(key, ticket(b"old"))
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data["tickets"]))  # the format without tokens
    old = SessionTicketCache(path)
    assert old.take_token(key) == b""
    restored = old.take(key)
    assert restored is not None and restored.ticket == b"old"
