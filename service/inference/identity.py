"""Who a call comes from, as far as the server can tell: the identity its client certificate
states, by grpcio's rule (`peer_identity_key`, then `peer_identities`), which grpcio, the
HTTP/3 server and the front-ends' dispatch endpoint all give the same way. A caller without a
certificate has no identity: it is anyone (a restricted-protocol header is shared by every
caller of its category, so it is no identity either)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The identity key, then the identities it names; empty: no client certificate.
Identity = tuple[bytes, ...]
ANYONE: Identity = ()


def identity_of(context: Any) -> Identity:
    """The caller's identity from its servicer context (grpcio's or one of ours)."""
    return identity_from(context.peer_identity_key(), context.peer_identities())


def identity_from(key: str | None, identities: Sequence[bytes] | None) -> Identity:
    """The identity grpcio's `peer_identity_key` and `peer_identities` state (ANYONE: none)."""
    if not key or not identities:
        return ANYONE
    return (key.encode(), *identities)


def client_name(identity: Identity, host: str) -> str:
    """Who a call comes from, as one client for the fair share of a model's places: its
    certificate's identity when it presented one, else its host's address (`host`)."""
    if identity:
        return "certificate " + b", ".join(identity).decode(errors="replace")
    return "address " + host
