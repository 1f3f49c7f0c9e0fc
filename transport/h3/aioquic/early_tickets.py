"""Session tickets sent with the server's Finished instead of after the client's (aioquic's
TLS server reached into).

aioquic issues a ticket only once the client's Finished arrives, so it reaches the client
about one round trip after the handshake: a client that resumed with 0-RTT has its answer by
then (the server answers early data with its first flight) and, if it closes at once, loses
the ticket; its next connection is a full handshake. RFC 8446 section 4.6.1 lets a server
that asked for no client certificate compute the rest of the transcript itself and send
NewSessionTicket right after its Finished; aioquic already hashed the Finished it expects
from the client when it waits for it, so the resumption secret is the same either way. The
ticket then rides in the server's first 1-RTT packet, and a client whose handshake completed
always holds its next ticket. Handshakes that ask for a certificate (mutual TLS, not
resumed) keep aioquic's timing: the client's Certificate is part of that secret.

The store then gets a ticket for a handshake the client may never complete; it gains nothing
by that (it could compute its Finished as well), and the store stays bounded as before.
"""

from __future__ import annotations

import os
import struct
from typing import Any

from aioquic import tls
from aioquic.quic.connection import QuicConnection

from transport.h3.aioquic.tls_context import configure_tls

# What aioquic's own tickets announce; the store's TTL bounds what the server accepts.
TICKET_LIFETIME_S = 86400


def issue_tickets_with_finished(quic: QuicConnection) -> None:
    """Send this server connection's session ticket with its Finished when the transcript
    allows (no client certificate asked for), and not again at the client's Finished."""
    configure_tls(quic, _issue_with_finished)


def _issue_with_finished(context: tls.Context) -> None:
    handle = context._handle_reassembled_message

    def handle_and_issue(
        message_type: int, input_buf: Any, output_buf: dict[tls.Epoch, Any]
    ) -> None:
        handle(message_type=message_type, input_buf=input_buf, output_buf=output_buf)
        if (
            message_type == tls.HandshakeType.CLIENT_HELLO
            and context.state == tls.State.SERVER_EXPECT_FINISHED
            and context.new_session_ticket_cb is not None
            and context._psk_key_exchange_mode is not None
        ):
            _issue(context, output_buf[tls.Epoch.ONE_RTT])

    context._handle_reassembled_message = handle_and_issue  # type: ignore[method-assign]


def _issue(context: tls.Context, buf: Any) -> None:
    """aioquic's own ticket (`_server_handle_finished`), sent now. Clearing the PSK mode
    keeps aioquic from issuing another at the client's Finished: it reads the mode for
    nothing else."""
    assert context.new_session_ticket_cb is not None
    message = tls.NewSessionTicket(
        ticket_lifetime=TICKET_LIFETIME_S,
        ticket_age_add=struct.unpack("I", os.urandom(4))[0],
        ticket_nonce=b"",
        ticket=os.urandom(64),
        max_early_data_size=context._max_early_data,
    )
    tls.push_new_session_ticket(buf, message)
    context._new_session_ticket = message
    context._psk_key_exchange_mode = None
    context.new_session_ticket_cb(
        context._build_session_ticket(message, context.handshake_extensions)
    )
