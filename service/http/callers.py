"""Who a REST request comes from, as a gRPC call's caller is known (service/api/callers.py):
the identity of the client certificate its TLS connection authenticated with (ASGI's TLS
extension, which this server's HTTP listeners and the front-ends' tunnel fill), else anyone;
and, for the fair share of a model's places, that identity or the client's address."""

from __future__ import annotations

import functools
import ipaddress

from cryptography import x509

from service.http.asgi import Scope
from service.inference.identity import ANYONE, Identity, client_name, identity_from
from service.inference.socket_owners import canonical
from transport.tls.peer_auth import PeerAuth

# Certificates whose identity is kept, per process: one per client a server sees at a time,
# each parsed once rather than on every request of its connections.
MAX_CACHED_CERTIFICATES = 256


def rest_identity(scope: Scope) -> Identity:
    """The identity of the request's client certificate (ANYONE without one)."""
    tls = scope.get("extensions", {}).get("tls")
    chain = tls.get("client_cert_chain") if isinstance(tls, dict) else None
    return _identity(chain[0]) if chain else ANYONE


def rest_client(scope: Scope, identity: Identity) -> str:
    """The request's client for a fair share: its identity, else its IP address (an
    IPv4-mapped address as IPv4, as gRPC's)."""
    client = scope.get("client")
    if not client:
        return client_name(identity, "unknown")
    try:
        host = str(canonical(ipaddress.ip_address(str(client[0]).strip("[]"))))
    except ValueError:
        host = str(client[0])  # a Unix socket's path
    return client_name(identity, host)


@functools.lru_cache(maxsize=MAX_CACHED_CERTIFICATES)
def _identity(pem: str) -> Identity:
    auth = PeerAuth(x509.load_pem_x509_certificate(pem.encode()), session_reused=False)
    return identity_from(auth.identity_key(), auth.identities())
