"""ASGI's shapes (https://asgi.readthedocs.io) as plain dicts, as every server passes them: what
an HTTP server of this package hands an application, and what the server's REST app takes; and
the TLS extension's entry of a scope, which the HTTP servers fill in the same way."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# TLS versions as ASGI's TLS extension numbers them (the protocol's own code points).
TLS_VERSIONS = {"TLSv1.2": 0x0303, "TLSv1.3": 0x0304}


def tls_extension(client_certificate: x509.Certificate | None, tls_version: str) -> Scope:
    """ASGI's TLS extension (`scope["extensions"]["tls"]`, spec 0.2) of a TLS connection: the
    certificate its client authenticated with, if any (PEM; the chain's rest is not kept), and
    the TLS version (`TLSv1.3`). What an app needs to know its caller by its certificate."""
    return {
        "server_cert": None,
        "client_cert_chain": (
            []
            if client_certificate is None
            else [client_certificate.public_bytes(Encoding.PEM).decode()]
        ),
        "client_cert_name": (
            None if client_certificate is None else client_certificate.subject.rfc4514_string()
        ),
        "client_cert_error": None,
        "tls_version": TLS_VERSIONS.get(tls_version),
        "cipher_suite": None,
    }
