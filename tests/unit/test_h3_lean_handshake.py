"""Handshake work cut on every new connection, between two in-memory aioquic connections:
the client generates two key shares instead of four and the server takes X25519; the frame
table's epoch sets are built once per process, not per connection."""

from __future__ import annotations

import ssl

from aioquic import tls
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from tests.unit.test_h3_limits import (
    SERVER_ADDRESS,
    Peer,
    exchange,
    server_configuration,  # noqa: F401  # the fixture
    server_quic,
)
from transport.h3.aioquic.lean_handshake import offer_cheap_key_shares, share_frame_epochs
from transport.h3.client import client_configuration


def test_the_client_offers_two_key_shares_and_the_server_takes_x25519(
    server_configuration: QuicConfiguration,  # noqa: F811
) -> None:
    configuration = client_configuration("localhost")
    configuration.verify_mode = ssl.CERT_NONE  # the development CA is not loaded here
    client = Peer(QuicConnection(configuration=configuration))
    server = Peer(server_quic(server_configuration, client))
    offer_cheap_key_shares(client.quic)
    client.quic.connect(SERVER_ADDRESS, now=1.0)
    assert client.quic.tls._supported_groups == [tls.Group.X25519, tls.Group.SECP256R1]
    assert client.quic.tls._x448_private_key is None
    assert len(client.quic.tls._ec_private_keys) == 1  # P-256 only, not P-384
    exchange(client, server)
    assert server.quic._handshake_complete
    assert server.quic.tls._x25519_private_key is not None  # the exchange it chose
    assert server.quic.tls._ec_private_keys == []


def test_connections_share_their_frame_epoch_sets() -> None:
    share_frame_epochs()
    share_frame_epochs()  # once is enough; again changes nothing
    first, second = (
        QuicConnection(configuration=QuicConfiguration(is_client=True)) for _ in range(2)
    )
    tables = [c._QuicConnection__frame_handlers for c in (first, second)]  # type: ignore[attr-defined]
    assert all(tables[0][kind][1] is tables[1][kind][1] for kind in tables[0])
    assert tables[0][0x08][1] == frozenset({tls.Epoch.ZERO_RTT, tls.Epoch.ONE_RTT})
