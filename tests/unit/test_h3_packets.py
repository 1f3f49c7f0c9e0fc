"""Packets per call: when ACKs go out, how many connection IDs are issued, between two
in-memory aioquic connections driven as GrpcH3Protocol drives them."""

from __future__ import annotations

import pytest
from aioquic import tls
from aioquic.quic.configuration import QuicConfiguration

from tests.unit.test_h3_limits import (
    CLIENT_ADDRESS,
    SERVER_ADDRESS,
    Peer,
    client_quic,
    exchange,
    server_configuration,  # noqa: F401  # the fixture
    server_quic,
)
from transport.h3.aioquic.acks import (
    ACK_DELAY_S,
    ack_with_next_packet,
    delay_acks,
    receive_datagram,
)
from transport.h3.aioquic.connection_ids import ACTIVE_CONNECTION_IDS, limit_connection_ids


@pytest.fixture
def peers(server_configuration: QuicConfiguration) -> tuple[Peer, Peer]:  # noqa: F811
    client = Peer(client_quic())
    server = Peer(server_quic(server_configuration, client))
    for peer in (client, server):
        delay_acks(peer.quic)
        limit_connection_ids(peer.quic)
    client.quic.connect(SERVER_ADDRESS, now=1.0)
    exchange(client, server)
    return client, server


def send(sender: Peer, receiver: Peer, stream_id: int, size: int) -> int:
    """Stream data from sender to receiver, received as the protocol does; the datagrams.
    The clock moves on a millisecond first, or aioquic's pacing could hold them back."""
    sender.now = receiver.now = max(sender.now, receiver.now) + 0.001
    sender.quic.send_stream_data(stream_id, b"x" * size)
    datagrams = sender.quic.datagrams_to_send(now=sender.now)
    source = CLIENT_ADDRESS if sender.quic.configuration.is_client else SERVER_ADDRESS
    for data, _ in datagrams:
        receive_datagram(receiver.quic, data, source, receiver.now)
    receiver.pump()
    return len(datagrams)


def test_the_ack_of_a_request_rides_with_its_answer(peers: tuple[Peer, Peer]) -> None:
    client, server = peers
    stream_id = client.quic.get_next_available_stream_id()
    assert send(client, server, stream_id, 1000) == 1
    server.now += ACK_DELAY_S / 2  # the call runs
    assert server.quic.datagrams_to_send(now=server.now) == []  # no ACK alone
    server.quic.send_stream_data(stream_id, b"answer", end_stream=True)
    ack_with_next_packet(server.quic, server.now)  # as GrpcH3Protocol does when it sends
    assert len(server.quic.datagrams_to_send(now=server.now)) == 1
    assert server.quic._spaces[tls.Epoch.ONE_RTT].ack_at is None  # the ACK went with it


def test_an_ack_held_back_leaves_at_its_delay(peers: tuple[Peer, Peer]) -> None:
    client, server = peers
    send(client, server, client.quic.get_next_available_stream_id(), 1000)
    assert server.quic.get_timer() == pytest.approx(server.now + ACK_DELAY_S)
    server.now += ACK_DELAY_S
    server.quic.handle_timer(now=server.now)
    assert len(server.quic.datagrams_to_send(now=server.now)) == 1


def test_every_second_datagram_is_acknowledged_at_once(peers: tuple[Peer, Peer]) -> None:
    """A large message: its sender is not kept waiting for ACKs."""
    client, server = peers
    assert send(client, server, client.quic.get_next_available_stream_id(), 2000) == 2
    assert len(server.quic.datagrams_to_send(now=server.now)) == 1


def test_small_datagrams_wait_for_the_ack_delay(peers: tuple[Peer, Peer]) -> None:
    """Two small ones (a HANDSHAKE_DONE, then a unary answer) are not a bulk transfer: no ACK
    alone before the client's CONNECTION_CLOSE."""
    client, server = peers
    send(server, client, 3, 10)
    send(server, client, 3, 100)
    assert client.quic._spaces[tls.Epoch.ONE_RTT].ack_at == pytest.approx(
        client.now - 0.001 + ACK_DELAY_S
    )
    assert client.quic.datagrams_to_send(now=client.now) == []


def test_a_held_ack_rides_with_the_clients_finished(
    server_configuration: QuicConfiguration,  # noqa: F811
) -> None:
    client = Peer(client_quic())
    server = Peer(server_quic(server_configuration, client))
    for peer in (client, server):
        delay_acks(peer.quic)
    client.quic.connect(SERVER_ADDRESS, now=client.now)
    for data, _ in client.quic.datagrams_to_send(now=client.now):
        receive_datagram(server.quic, data, CLIENT_ADDRESS, server.now)
    server.pump()
    server.quic.send_stream_data(3, b"x")  # 1-RTT data in the server's first flight
    for data, _ in server.quic.datagrams_to_send(now=server.now):
        receive_datagram(client.quic, data, SERVER_ADDRESS, client.now)
    space = client.quic._spaces[tls.Epoch.ONE_RTT]
    assert client.quic._handshake_complete
    assert space.ack_at == client.now  # due with the Finished, not in ACK_DELAY_S
    client.quic.datagrams_to_send(now=client.now)
    assert space.ack_at is None


def test_an_ack_only_datagram_does_not_hurry_a_held_ack(peers: tuple[Peer, Peer]) -> None:
    client, server = peers
    send(server, client, 3, 10)  # the client now owes the server an ACK
    send(client, server, client.quic.get_next_available_stream_id(), 1000)
    held = server.quic._spaces[tls.Epoch.ONE_RTT].ack_at
    assert held is not None
    client.now += ACK_DELAY_S
    client.quic.handle_timer(now=client.now)
    datagrams = client.quic.datagrams_to_send(now=client.now)
    assert len(datagrams) == 1
    receive_datagram(server.quic, datagrams[0][0], CLIENT_ADDRESS, server.now)
    assert server.quic._spaces[tls.Epoch.ONE_RTT].ack_at == held


def test_connection_ids_are_limited_both_ways(peers: tuple[Peer, Peer]) -> None:
    client, server = peers
    for peer in (client, server):
        assert len(peer.quic._host_cids) == ACTIVE_CONNECTION_IDS
        assert len(peer.quic._peer_cid_available) + 1 == ACTIVE_CONNECTION_IDS
