"""Client-side cache of TLS session tickets, per server, for 0-RTT reconnects, and of the
server's NEW_TOKEN address tokens, which spare the next connection a QUIC Retry.

A ticket is used at most once (taken out of the cache when a connection starts with it); the
server sends a fresh one on every resumed connection. Tokens too: only the newest is kept, and
it is taken, so two connections never show the same one (RFC 9000 section 8.1.3: a token
reused would link them). With `path`, both survive a restart of the client process: the file
holds resumption secrets, so it is written with mode 0600 and must be treated like a private
key.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from aioquic.tls import CipherSuite, SessionTicket

MAX_TOKEN_BYTES = 1024  # what is kept of a server's token; a longer one is dropped


class SessionTicketCache:
    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._tickets: dict[str, SessionTicket] = {}
        self._tokens: dict[str, bytes] = {}
        self._lock = threading.Lock()
        if self.path is not None and self.path.exists():
            self._tickets, self._tokens = _load(self.path)

    @staticmethod
    def key(server_name: str, host: str, port: int, client_cert: bytes = b"") -> str:
        """Per server and per client certificate: a ticket resumes the identity of the
        connection that received it, so a channel with another certificate must not take it."""
        key = f"{server_name}@{host}:{port}"
        return f"{key}#{hashlib.sha256(client_cert).hexdigest()[:32]}" if client_cert else key

    def take(self, key: str) -> SessionTicket | None:
        """The server's ticket, removed from the cache: a ticket is used at most once."""
        with self._lock:
            ticket = self._tickets.pop(key, None)
            if ticket is not None:
                self._save()
            return ticket if ticket is not None and ticket.is_valid else None

    def add(self, key: str, ticket: SessionTicket) -> None:
        with self._lock:
            self._tickets[key] = ticket
            self._save()

    def take_token(self, key: str) -> bytes:
        """The server's newest address token, removed from the cache (b"": none)."""
        with self._lock:
            token = self._tokens.pop(key, b"")
            if token:
                self._save()
            return token

    def add_token(self, key: str, token: bytes) -> None:
        if not token or len(token) > MAX_TOKEN_BYTES:
            return
        with self._lock:
            self._tokens[key] = token
            self._save()

    def __contains__(self, key: str) -> bool:
        return key in self._tickets

    def _save(self) -> None:
        if self.path is None:
            return
        data = {
            "tickets": {key: _encode(ticket) for key, ticket in self._tickets.items()},
            "tokens": {key: base64.b64encode(t).decode() for key, t in self._tokens.items()},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tickets-")
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as handle:
                json.dump(data, handle)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _encode(ticket: SessionTicket) -> dict[str, Any]:
    return {
        "age_add": ticket.age_add,
        "cipher_suite": int(ticket.cipher_suite),
        "not_valid_after": ticket.not_valid_after.isoformat(),
        "not_valid_before": ticket.not_valid_before.isoformat(),
        "resumption_secret": base64.b64encode(ticket.resumption_secret).decode(),
        "server_name": ticket.server_name,
        "ticket": base64.b64encode(ticket.ticket).decode(),
        "max_early_data_size": ticket.max_early_data_size,
        "other_extensions": [
            [kind, base64.b64encode(value).decode()] for kind, value in ticket.other_extensions
        ],
    }


def _load(path: Path) -> tuple[dict[str, SessionTicket], dict[str, bytes]]:
    """Unreadable or foreign content is ignored: the cost is one full handshake. A file written
    before tokens were kept holds tickets alone."""
    try:
        data = json.loads(path.read_text())
        if "tickets" not in data:
            data = {"tickets": data, "tokens": {}}
        tokens = {str(key): base64.b64decode(token) for key, token in data["tokens"].items()}
        tickets = {
            key: SessionTicket(
                age_add=int(item["age_add"]),
                cipher_suite=CipherSuite(int(item["cipher_suite"])),
                not_valid_after=datetime.datetime.fromisoformat(item["not_valid_after"]),
                not_valid_before=datetime.datetime.fromisoformat(item["not_valid_before"]),
                resumption_secret=base64.b64decode(item["resumption_secret"]),
                server_name=str(item["server_name"]),
                ticket=base64.b64decode(item["ticket"]),
                max_early_data_size=item["max_early_data_size"],
                other_extensions=[
                    (int(kind), base64.b64decode(value)) for kind, value in item["other_extensions"]
                ],
            )
            for key, item in data["tickets"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}, {}
    return tickets, tokens
