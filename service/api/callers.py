"""Who a call comes from, as one client for the fair share of a model's places: the identity
of its client certificate when it presented one, else its IP address (every connection from
one address is one client, since opening another connection costs an attacker nothing; the
port is left out, and an IPv4 address is the same client over IPv4 and as an IPv4-mapped
IPv6 address)."""

from __future__ import annotations

import ipaddress
import urllib.parse

from service.inference.errors import ServicerContext
from service.inference.identity import client_name, identity_of
from service.inference.socket_owners import Address, canonical


def client_of(context: ServicerContext) -> str:
    return client_name(identity_of(context), peer_host(context.peer()))


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string, an IPv4-mapped address as IPv4; the whole string when
    it has none (`unix:PATH`)."""
    socket = peer_socket(peer)
    return str(canonical(socket[0])) if socket else peer


def peer_socket(peer: str) -> tuple[Address, int] | None:
    """The address and port of a gRPC peer string: `ipv4:HOST:PORT` or `ipv6:[HOST]:PORT`,
    which grpcio percent-encodes (`ipv6:%5B::1%5D:PORT`); None for any other (`unix:`)."""
    kind, _, rest = peer.partition(":")
    host, _, port = urllib.parse.unquote(rest).rpartition(":")
    if kind == "ipv6":
        if not (host.startswith("[") and host.endswith("]")):
            return None
        host = host[1:-1]
    elif kind != "ipv4":
        return None
    try:
        return ipaddress.ip_address(host), int(port)
    except ValueError:
        return None
