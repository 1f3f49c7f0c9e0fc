"""Session tickets encrypted for a shared store: whoever can read the store (Redis, its backups)
must not get usable resumption secrets, nor the labels clients present.

From one secret key two keys are derived (HKDF-SHA256): one names entries (HMAC of the ticket
label, so the store never sees a label), one seals them (AES-256-GCM, with the entry's name as
associated data, so a sealed ticket moved under another name does not open). The store's expiry
is sealed with the ticket: a store that edits an entry's expiry cannot make it live longer.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import os
import stat
from pathlib import Path

from aioquic.tls import CipherSuite, SessionTicket
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from transport.h3.address_tokens import KEY_BYTES
from transport.tls.session_tickets import TicketCounters

log = logging.getLogger(__name__)

MIN_KEY_BYTES = 32
_NONCE_BYTES = 12
_SHARED_KEY_BITS = stat.S_IWGRP | stat.S_IRWXO


class TicketKeyError(ValueError):
    """The ticket key is missing, too short or unreadable."""


def _check_length(secret: bytes) -> None:
    if len(secret) < MIN_KEY_BYTES:
        raise TicketKeyError(f"the ticket key must hold at least {MIN_KEY_BYTES} bytes")


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=purpose).derive(secret)


class TicketSealer:
    def __init__(self, secret: bytes) -> None:
        _check_length(secret)
        self._name_key = _derive(secret, b"paddlequic ticket name")
        self._aead = AESGCM(_derive(secret, b"paddlequic ticket seal"))

    @classmethod
    def from_file(cls, path: Path) -> TicketSealer:
        return cls(read_ticket_key(path))

    def name(self, label: bytes) -> bytes:
        return hmac.new(self._name_key, label, hashlib.sha256).digest()

    def seal(self, ticket: SessionTicket, expires: float) -> tuple[bytes, bytes]:
        """(entry name, sealed ticket); `expires` is a wall-clock time (seconds since the
        epoch), which the servers sharing the store agree on."""
        name = self.name(ticket.ticket)
        nonce = os.urandom(_NONCE_BYTES)
        return name, nonce + self._aead.encrypt(nonce, _encode(ticket, expires), name)

    def open(self, label: bytes, sealed: bytes) -> tuple[SessionTicket, float]:
        """The ticket and its sealed expiry. Raises cryptography's InvalidTag when the entry
        was sealed with another key or for another label."""
        name = self.name(label)
        plain = self._aead.decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], name)
        return _decode(plain)


def read_ticket_key(path: Path) -> bytes:
    """The file's bytes are the key (for example `head -c 32 /dev/urandom`); every server
    sharing a store needs the same file. Whoever reads it can open every sealed ticket and
    seal new ones, so a file other users can read, or that group or others can write, is
    refused (group read is allowed: Kubernetes' fsGroup turns a 0400 secret into 0440)."""
    try:
        with path.open("rb") as handle:
            mode = stat.S_IMODE(os.fstat(handle.fileno()).st_mode)
            secret = handle.read()
    except OSError as exc:
        raise TicketKeyError(f"cannot read the ticket key {path}: {exc}") from exc
    if mode & _SHARED_KEY_BITS:
        raise TicketKeyError(
            f"the ticket key {path} has mode {mode:04o}: other users can read or replace "
            f"it; make it private with `chmod 600 {path}`"
        )
    return secret


def address_token_key(key_file: str) -> bytes:
    """The key of NEW_TOKEN address tokens (transport/h3/address_tokens.py): derived from
    the ticket key file, so every server sharing it accepts the others' tokens; without one,
    a random key (this process's tokens only, until it restarts)."""
    if not key_file:
        return os.urandom(KEY_BYTES)
    secret = read_ticket_key(Path(key_file))
    _check_length(secret)
    return _derive(secret, b"paddlequic address token")


def redeem(
    sealer: TicketSealer,
    label: bytes,
    sealed: bytes | None,
    now: float,
    counters: TicketCounters,
) -> SessionTicket | None:
    """A shared store's answer to a ticket label at wall-clock time `now`: the ticket, or None
    (counted as refused) when the entry was missing, expired or altered. Another key names
    entries differently, so an entry that does not open was altered in the store; one the store
    still held past its sealed expiry had its expiry edited there, or was put back."""
    ticket = None
    if sealed is not None:
        try:
            ticket, expires = sealer.open(label, sealed)
        except InvalidTag:
            log.warning("a sealed session ticket in the shared store did not open: altered")
        else:
            if expires <= now:
                log.warning(
                    "a session ticket in the shared store outlived its sealed expiry: its "
                    "expiry was edited in the store, or the servers' clocks disagree"
                )
                ticket = None
    if ticket is None:
        counters.refused += 1
    else:
        counters.redeemed += 1
    return ticket


def _encode(ticket: SessionTicket, expires: float) -> bytes:
    return json.dumps(
        {
            "expires": expires,
            "age_add": ticket.age_add,
            "cipher_suite": int(ticket.cipher_suite),
            "not_valid_after": ticket.not_valid_after.isoformat(),
            "not_valid_before": ticket.not_valid_before.isoformat(),
            "resumption_secret": ticket.resumption_secret.hex(),
            "server_name": ticket.server_name,
            "ticket": ticket.ticket.hex(),
            "max_early_data_size": ticket.max_early_data_size,
            "other_extensions": [[kind, data.hex()] for kind, data in ticket.other_extensions],
        }
    ).encode()


def _decode(plain: bytes) -> tuple[SessionTicket, float]:
    fields = json.loads(plain)
    ticket = SessionTicket(
        age_add=fields["age_add"],
        cipher_suite=CipherSuite(fields["cipher_suite"]),
        not_valid_after=datetime.datetime.fromisoformat(fields["not_valid_after"]),
        not_valid_before=datetime.datetime.fromisoformat(fields["not_valid_before"]),
        resumption_secret=bytes.fromhex(fields["resumption_secret"]),
        server_name=fields["server_name"],
        ticket=bytes.fromhex(fields["ticket"]),
        max_early_data_size=fields["max_early_data_size"],
        other_extensions=[(kind, bytes.fromhex(data)) for kind, data in fields["other_extensions"]],
    )
    # An entry sealed before expiries were (an older paddlequic) is refused as expired.
    return ticket, float(fields.get("expires", 0.0))
