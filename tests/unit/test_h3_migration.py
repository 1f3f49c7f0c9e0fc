"""A client whose address changed while the server's answer was on its way to the old one:
the answer goes again to the new address as soon as the client's first packet from there
arrives, without waiting for a probe timeout. Two in-memory aioquic connections, the clock
moved by hand."""

from __future__ import annotations

import pytest
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import NetworkAddress

from tests.unit.test_h3_limits import (
    CLIENT_ADDRESS,
    SERVER_ADDRESS,
    Peer,
    client_quic,
    exchange,
    server_configuration,  # noqa: F401  # the fixture
    server_quic,
)
from transport.h3.aioquic.migration import resend_after_migration

NEW_CLIENT_ADDRESS = ("192.0.2.3", 50000)
STEP_S = 0.001  # far below the loss-detection delay (9/8 of the 10 ms RTT exchange() gives)


@pytest.fixture
def peers(server_configuration: QuicConfiguration) -> tuple[Peer, Peer]:  # noqa: F811
    client = Peer(client_quic())
    server = Peer(server_quic(server_configuration, client))
    resend_after_migration(server.quic)
    client.quic.connect(SERVER_ADDRESS, now=1.0)
    exchange(client, server)
    return client, server


def deliver(sender: Peer, receiver: Peer, source: NetworkAddress) -> list[NetworkAddress]:
    """What the sender has to send, received from `source`; where the sender sent it."""
    sender.now = receiver.now = max(sender.now, receiver.now) + STEP_S
    sent = sender.quic.datagrams_to_send(now=sender.now)
    for data, _ in sent:
        receiver.quic.receive_datagram(data, source, now=receiver.now)
    return [address for _, address in sent]


def answer(client: Peer) -> bytes:
    received = b""
    while (event := client.quic.next_event()) is not None:
        if isinstance(event, events.StreamDataReceived):
            received += event.data
    return received


def test_an_answer_lost_to_the_old_address_goes_to_the_new_one_at_once(
    peers: tuple[Peer, Peer],
) -> None:
    client, server = peers
    answer(client)  # the handshake's events
    stream_id = client.quic.get_next_available_stream_id()
    client.quic.send_stream_data(stream_id, b"request")
    deliver(client, server, CLIENT_ADDRESS)
    server.quic.send_stream_data(stream_id, b"answer", end_stream=True)
    server.now += STEP_S
    lost = server.quic.datagrams_to_send(now=server.now)  # to the old address: never arrives
    assert [address for _, address in lost] == [CLIENT_ADDRESS]
    client.quic.send_ping(1)  # the client, at its new address, says something
    deliver(client, server, NEW_CLIENT_ADDRESS)
    for _ in range(3):  # the server's PATH_CHALLENGE, the client's PATH_RESPONSE, the answer
        assert set(deliver(server, client, SERVER_ADDRESS)) <= {NEW_CLIENT_ADDRESS}
        deliver(client, server, NEW_CLIENT_ADDRESS)
    assert answer(client) == b"answer"
