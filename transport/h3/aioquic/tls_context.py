"""What a server connection's TLS context does that aioquic has no setting for: early data
refused, client certificates asked for, checked and kept in session tickets."""

from __future__ import annotations

from collections.abc import Callable

from aioquic import tls
from aioquic.buffer import Buffer  # type: ignore[attr-defined]
from aioquic.quic.connection import QuicConnection
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding


def configure_tls(quic: QuicConnection, configure: Callable[[tls.Context], None]) -> None:
    """Run `configure` on a connection's TLS context as soon as it exists (a client's when it
    connects, a server's when the first packet arrives), before any handshake message:
    aioquic offers no setting for what is done here."""
    initialize = quic._initialize

    def initialize_and_configure(peer_cid: bytes) -> None:
        initialize(peer_cid)
        configure(quic.tls)

    quic._initialize = initialize_and_configure  # type: ignore[method-assign]


def refuse_early_data(quic: QuicConnection) -> None:
    """Issue tickets that do not allow early data (resumption stays)."""

    def without_early_data(context: tls.Context) -> None:
        context._max_early_data = None

    configure_tls(quic, without_early_data)


CertificateCheck = Callable[[x509.Certificate | None, list[x509.Certificate]], None]

# A private-use TLS extension type (RFC 8446 section 4.2: 65280-65535). In the server's own copy
# of a session ticket, one entry per certificate of the chain the client authenticated with, leaf
# first. A server never sends its copy's extensions; aioquic reads ticket extensions on clients
# only (the transport parameters for 0-RTT).
CLIENT_CERTIFICATE_EXTENSION = 0xFF5C


def request_client_certificate(context: tls.Context, check: CertificateCheck) -> None:
    """Ask the client for a certificate and hand what it sends (leaf or None, then the chain)
    to `check`, which raises a `tls.Alert` to refuse it. aioquic asks only behind a private
    flag, and on a server it checks the client's handshake signature (proof it holds the key)
    but never the chain: `verify_mode`/`cafile` do nothing there.

    A resumed handshake (session ticket, 0-RTT) sends no CertificateRequest, as TLS 1.3 wants,
    but behind that flag aioquic 1.7.2 still waits for a Certificate and aborts at the
    client's Finished (unexpected_message, QUIC error 0x10a). So here the server's tickets
    carry the chain the client authenticated with; a resumption passes it to `check` again (a
    ticket whose chain no longer passes is refused: full handshake, certificate asked anew),
    restores it as the peer certificate before any early data is read, and expects Finished
    next. Only the client holding the ticket's resumption secret can complete a resumption
    (the PSK binder), so a ticket authenticates the client it was issued to and no other."""
    context._request_client_certificate = True
    handle_certificate = context._server_handle_certificate
    handle_hello = context._server_handle_hello
    fetch = context.get_session_ticket_cb
    issue = context.new_session_ticket_cb
    resumed: list[x509.Certificate] = []

    def handle_and_check(input_buf: Buffer) -> None:
        handle_certificate(input_buf)
        check(context._peer_certificate, context._peer_certificate_chain)

    def fetch_and_check(label: bytes) -> tls.SessionTicket | None:
        assert fetch is not None
        ticket = fetch(label)
        if ticket is None:
            return None
        chain = [
            x509.load_der_x509_certificate(data)
            for kind, data in ticket.other_extensions
            if kind == CLIENT_CERTIFICATE_EXTENSION
        ]
        try:
            check(chain[0] if chain else None, chain[1:])
        except tls.Alert:
            return None
        resumed[:] = chain
        return ticket

    def handle_hello_and_resume(
        input_buf: Buffer, initial_buf: Buffer, handshake_buf: Buffer
    ) -> None:
        handle_hello(input_buf, initial_buf, handshake_buf)
        if context._session_resumed and context.state == tls.State.SERVER_EXPECT_CERTIFICATE:
            if resumed:
                context._peer_certificate, context._peer_certificate_chain = (
                    resumed[0],
                    resumed[1:],
                )
            context._server_expect_finished()

    def issue_with_certificate(ticket: tls.SessionTicket) -> None:
        assert issue is not None
        leaf = context._peer_certificate
        if leaf is not None:
            ticket.other_extensions = [
                *ticket.other_extensions,
                *(
                    (CLIENT_CERTIFICATE_EXTENSION, certificate.public_bytes(Encoding.DER))
                    for certificate in (leaf, *context._peer_certificate_chain)
                ),
            ]
        issue(ticket)

    context._server_handle_certificate = handle_and_check  # type: ignore[method-assign]
    context._server_handle_hello = handle_hello_and_resume  # type: ignore[method-assign]
    if fetch is not None:
        context.get_session_ticket_cb = fetch_and_check
    if issue is not None:
        context.new_session_ticket_cb = issue_with_certificate


def peer_certificate(quic: QuicConnection) -> x509.Certificate | None:
    """A server connection's client certificate: verified in its handshake, or restored from
    its session ticket when it resumed (`request_client_certificate`)."""
    return quic.tls._peer_certificate
