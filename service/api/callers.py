"""Who a call comes from, as one client for the fair share of a model's places: the identity
of its client certificate when it presented one, else its IP address (every connection from
one address is one client, since opening another connection costs an attacker nothing; the
port is left out, and an IPv4 address is the same client over IPv4 and as an IPv4-mapped
IPv6 address)."""

from __future__ import annotations

import ipaddress
from urllib.parse import unquote

from service.inference.errors import ServicerContext


def client_of(context: ServicerContext) -> str:
    identities = context.peer_identities()
    if identities:
        return "certificate " + b", ".join(identities).decode(errors="replace")
    return "address " + peer_host(context.peer())


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (`ipv4:HOST:PORT`, `ipv6:[HOST]:PORT`, percent-encoded
    or not, `unix:PATH`); the whole string when it has none."""
    kind, _, address = unquote(peer).partition(":")
    if kind == "ipv6":
        host = address.rpartition("]")[0].lstrip("[")
    elif kind == "ipv4":
        host = address.rpartition(":")[0]
    else:
        return peer
    try:
        parsed = ipaddress.ip_address(host)
    except ValueError:
        return peer
    mapped = parsed.ipv4_mapped if isinstance(parsed, ipaddress.IPv6Address) else None
    return str(mapped or parsed)
