"""Work aioquic does on every new connection that a gRPC client and server need not: key
shares the server never uses, the frame table's epoch sets built anew, and the handshake's
buffers kept for the connection's life (aioquic's TLS client and connection module reached
into)."""

from __future__ import annotations

import functools

from aioquic import tls
from aioquic.buffer import Buffer  # type: ignore[attr-defined]
from aioquic.quic import connection as connection_module
from aioquic.quic.connection import QuicConnection

from transport.h3.aioquic.tls_context import configure_tls

# What a client offers, in order. aioquic's client generates a key share for each group it
# supports (P-256, P-384, X25519, X448: four key pairs, two of them slow) and its server takes
# the first it supports, so P-256. X25519 is the cheapest exchange on both ends and every QUIC
# stack has it; P-256 (mandatory in TLS 1.3) stays as a fallback. aioquic has no
# HelloRetryRequest, so a group the server lacks cannot be asked for later.
KEY_SHARE_GROUPS = (tls.Group.X25519, tls.Group.SECP256R1)


def offer_cheap_key_shares(quic: QuicConnection) -> None:
    """A client connection offers key shares for `KEY_SHARE_GROUPS` only (those its
    cryptography backend supports)."""

    def narrow(context: tls.Context) -> None:
        context._supported_groups = [g for g in KEY_SHARE_GROUPS if g in context._supported_groups]

    configure_tls(quic, narrow)


def share_frame_epochs() -> None:
    """aioquic's QuicConnection builds its frame handler table in `__init__` with
    `EPOCHS(shortcut)`, a new frozenset per frame type (33 per connection, each hashing
    enum members in Python). The sets never change: each shortcut's is built once."""
    epochs = connection_module.EPOCHS
    if not isinstance(epochs, functools._lru_cache_wrapper):
        connection_module.EPOCHS = functools.cache(epochs)


def release_handshake_buffers(quic: QuicConnection) -> None:
    """aioquic gives each connection three 16 KB buffers for the TLS messages it writes in
    the handshake (one per epoch) and keeps them while the connection lives; what the
    handshake wrote into them stays resident (an idle HTTP/3 connection's RSS on the server:
    81 KB with them, 67 KB without). Once a server's handshake is done its TLS writes nothing
    more (any handshake message then is an unexpected-message alert, which closes the
    connection), so the buffers are swapped for empty ones."""
    context = getattr(quic, "tls", None)  # made when the first datagram comes
    if context is not None and context.state == tls.State.SERVER_POST_HANDSHAKE:
        quic._crypto_buffers = {epoch: Buffer(capacity=0) for epoch in quic._crypto_buffers}
