"""Handshake work cut on every new connection, between two in-memory aioquic connections:
the client generates two key shares instead of four and the server takes X25519; the frame
table's epoch sets are built once per process, not per connection; a server lets go of its
handshake buffers once the handshake is done, and the connection goes on carrying data."""

from __future__ import annotations

import ssl

from aioquic import tls
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from tests.unit.test_h3_limits import (
    CLIENT_ADDRESS,
    SERVER_ADDRESS,
    Peer,
    client_quic,
    exchange,
    server_configuration,  # noqa: F401  # the fixture
    server_quic,
)
from transport.h3.aioquic.lean_handshake import (
    offer_cheap_key_shares,
    release_handshake_buffers,
    share_frame_epochs,
)
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


class Recording(Peer):
    """A peer that keeps every event its connection gives."""

    def __init__(self, quic: QuicConnection) -> None:
        super().__init__(quic)
        self.events: list[events.QuicEvent] = []

    def pump(self) -> None:
        while (event := self.quic.next_event()) is not None:
            self.events.append(event)

    def received(self, stream_id: int) -> bytes:
        return b"".join(
            e.data
            for e in self.events
            if isinstance(e, events.StreamDataReceived) and e.stream_id == stream_id
        )


def _buffered(quic: QuicConnection) -> int:
    return sum(buf.capacity for buf in quic._crypto_buffers.values())


def test_a_server_lets_go_of_its_handshake_buffers_once_done_and_keeps_carrying_data(
    server_configuration: QuicConfiguration,  # noqa: F811
) -> None:
    client = Recording(client_quic())
    client.quic.connect(SERVER_ADDRESS, now=1.0)
    server = Recording(server_quic(server_configuration, client))
    release_handshake_buffers(server.quic)  # before the ClientHello: nothing to let go of
    for data, _ in client.quic.datagrams_to_send(now=1.0):
        server.quic.receive_datagram(data, CLIENT_ADDRESS, now=1.0)
    release_handshake_buffers(server.quic)  # mid-handshake (it waits for Finished): kept
    assert _buffered(server.quic) == 3 * 16384
    exchange(client, server)
    assert any(isinstance(e, events.HandshakeCompleted) for e in server.events)
    release_handshake_buffers(client.quic)  # a client's: kept (a server's only)
    release_handshake_buffers(server.quic)
    assert _buffered(client.quic) == 3 * 16384
    assert _buffered(server.quic) == 0
    payload = bytes(range(256)) * 200  # several datagrams each way
    client.quic.send_stream_data(0, payload, end_stream=True)
    exchange(client, server)
    server.quic.send_stream_data(0, payload[::-1], end_stream=True)
    exchange(client, server)
    assert server.received(0) == payload
    assert client.received(0) == payload[::-1]
    client.quic.close(reason_phrase="done")
    exchange(client, server)
    server.quic.handle_timer(now=server.now + 60)  # past the draining period
    server.pump()
    assert any(isinstance(e, events.ConnectionTerminated) for e in server.events)
