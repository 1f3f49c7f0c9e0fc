"""Client certificates (mutual TLS) on the HTTP/3 server.

aioquic 1.7.2 (pinned) has no server setting for them: its TLS context asks for a client
certificate only behind a private flag, and on the server it checks the certificate's
signature over the handshake (proof that the client holds the key) but never the chain, so
`verify_mode`/`cafile` do nothing there. This module sets the flag on each connection's TLS
context when aioquic creates it and verifies the chain (against our CA only, not the system
roots), the validity dates and the client-auth purpose as soon as the Certificate message
arrives, before the handshake can finish.

A resumed connection (session ticket, 0-RTT) is not asked again, as TLS 1.3 specifies: it
carries the authentication of the full handshake that issued its ticket, and no ticket is
issued to a client refused here, since tickets are sent only after the client's Finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aioquic import tls
from aioquic._buffer import Buffer
from aioquic.quic.connection import QuicConnection
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID


class AlertCertificateRequired(tls.Alert):
    description = tls.AlertDescription.certificate_required


@dataclass(frozen=True)
class ClientAuth:
    """`ca_file`: PEM CA certificates client certificates must chain to; `required`: refuse
    clients that send none (otherwise they are let in, and a certificate sent is checked)."""

    ca_file: Path
    required: bool


def request_client_certificates(quic: QuicConnection, auth: ClientAuth) -> None:
    """Ask this server connection's clients for a certificate and verify it. aioquic creates
    the TLS context when the first packet arrives, hence the wrapper around that step."""
    initialize = quic._initialize

    def initialize_with_client_auth(peer_cid: bytes) -> None:
        initialize(peer_cid)
        _verify_client_certificates(quic.tls, auth)

    quic._initialize = initialize_with_client_auth  # type: ignore[method-assign]


def _verify_client_certificates(context: tls.Context, auth: ClientAuth) -> None:
    context._request_client_certificate = True
    handle_certificate = context._server_handle_certificate

    def handle_and_verify(input_buf: Buffer) -> None:
        handle_certificate(input_buf)
        certificate = context._peer_certificate
        if certificate is None:
            if auth.required:
                raise AlertCertificateRequired("a client certificate is required")
            return
        tls.verify_certificate(
            certificate=certificate,
            chain=context._peer_certificate_chain,
            cafile=str(auth.ca_file),
        )
        if not _for_client_auth(certificate):
            raise tls.AlertBadCertificate("the certificate is not for client authentication")

    context._server_handle_certificate = handle_and_verify  # type: ignore[method-assign]


def _for_client_auth(certificate: x509.Certificate) -> bool:
    """No extended key usage means any usage; one that is listed must include clientAuth."""
    try:
        usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True
    return ExtendedKeyUsageOID.CLIENT_AUTH in usage
