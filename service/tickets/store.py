"""Which session ticket store this server uses (--ticket-store, --ticket-key-file), and the
address tokens sealed with the same key (--h3-token-lifetime)."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from service.tickets.seal import TicketKeyError, TicketSealer, address_token_key
from service.tickets.sqlite_store import SqliteTicketStore
from transport.h3.address_tokens import AddressTokens
from transport.tls.session_tickets import MemoryTicketStore, TicketStore

log = logging.getLogger(__name__)

_REDIS_SCHEMES = ("redis://", "rediss://")
_SQLITE_SCHEME = "sqlite://"


class TicketStoreError(ValueError):
    """A ticket store that cannot be served as configured."""


def open_ticket_store(url: str, key_file: str, ttl_s: float) -> TicketStore:
    """Misconfiguration fails the start; an unreachable Redis only turns 0-RTT off (warned)."""
    if url == "memory":
        return MemoryTicketStore(ttl_s=ttl_s)
    if not url.startswith((*_REDIS_SCHEMES, _SQLITE_SCHEME)):
        raise TicketStoreError(
            f"--ticket-store {url!r}: expected memory, sqlite://PATH, redis:// or rediss://"
        )
    if not key_file:
        raise TicketStoreError(
            "a shared --ticket-store needs --ticket-key-file: the store must not hold usable "
            "resumption secrets"
        )
    try:
        sealer = TicketSealer.from_file(Path(key_file))
    except TicketKeyError as exc:
        raise TicketStoreError(str(exc)) from exc
    if url.startswith(_SQLITE_SCHEME):
        path = Path(url.removeprefix(_SQLITE_SCHEME))
        try:
            sqlite_store = SqliteTicketStore(path, sealer, ttl_s)
        except (OSError, sqlite3.Error) as exc:
            raise TicketStoreError(f"--ticket-store {url}: {exc}") from exc
        log.info("session tickets in %s, sealed with --ticket-key-file", path)
        return sqlite_store
    # Here, not at the top: redis-py takes about a seventh of a second to import, which every
    # server start (and every front-end's) paid whether it used Redis or not.
    from service.tickets.redis_store import RedisTicketStore

    store = RedisTicketStore.from_url(url, sealer, ttl_s)
    if store.check():
        log.info("session tickets in Redis, sealed with --ticket-key-file")
    return store


def open_address_tokens(key_file: str, lifetime_s: float) -> AddressTokens | None:
    """NEW_TOKEN address tokens, None when the lifetime is 0 (the server sends none)."""
    if lifetime_s <= 0:
        return None
    try:
        return AddressTokens(address_token_key(key_file), lifetime_s)
    except TicketKeyError as exc:
        raise TicketStoreError(str(exc)) from exc
