"""Client certificates (mutual TLS) on the HTTP/3 server.

aioquic 1.7.2 (pinned) has no server setting for them (the hooks that reach into its TLS
context are in tls_context.py). This module is the policy: the chain is verified against our
CA only (not the system roots), with the validity dates and the client-auth purpose, as soon as
the Certificate message arrives, before the handshake can finish.

A resumed connection (session ticket, 0-RTT) is not asked again, as TLS 1.3 specifies: it
carries the authentication of the full handshake that issued its ticket. The server's ticket
keeps the certificate chain the client authenticated with (sealed with the rest of the ticket
in a shared store); resuming passes it through the same check again (a certificate expired or
no longer trusted since gets a full handshake) and shows it to servicers as the peer's. No
ticket is issued to a client refused here: tickets are sent only after the client's Finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aioquic import tls
from aioquic.quic.connection import QuicConnection
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from transport.h3.aioquic.tls_context import configure_tls, request_client_certificate


class AlertCertificateRequired(tls.Alert):
    description = tls.AlertDescription.certificate_required


@dataclass(frozen=True)
class ClientAuth:
    """`ca_file`: PEM CA certificates client certificates must chain to; `required`: refuse
    clients that send none (otherwise they are let in, and a certificate sent is checked)."""

    ca_file: Path
    required: bool


def request_client_certificates(quic: QuicConnection, auth: ClientAuth) -> None:
    """Ask this server connection's clients for a certificate and verify it before the
    handshake can finish."""

    def check(certificate: x509.Certificate | None, chain: list[x509.Certificate]) -> None:
        if certificate is None:
            if auth.required:
                raise AlertCertificateRequired("a client certificate is required")
            return
        tls.verify_certificate(certificate=certificate, chain=chain, cafile=str(auth.ca_file))
        if not _for_client_auth(certificate):
            raise tls.AlertBadCertificate("the certificate is not for client authentication")

    configure_tls(quic, lambda context: request_client_certificate(context, check))


def _for_client_auth(certificate: x509.Certificate) -> bool:
    """No extended key usage means any usage; one that is listed must include clientAuth."""
    try:
        usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True
    return ExtendedKeyUsageOID.CLIENT_AUTH in usage
