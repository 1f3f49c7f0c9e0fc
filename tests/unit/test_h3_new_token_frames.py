"""NEW_TOKEN frames between two in-memory aioquic connections: the token rides in the server's
first flight, a lost one is sent again (a fresh token), and once one is acknowledged the server
connection sends through aioquic's own method."""

from __future__ import annotations

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import NetworkAddress, QuicConnection

from tests.unit.test_h3_limits import (
    CLIENT_ADDRESS,
    SERVER_ADDRESS,
    Peer,
    client_quic,
    exchange,
    server_configuration,  # noqa: F401  # the fixture
    server_quic,
)
from transport.h3.aioquic.new_token import send_new_token


class Issuer:
    """Tokens numbered in the order issued, and the addresses they were issued to."""

    def __init__(self) -> None:
        self.addresses: list[NetworkAddress] = []

    def __call__(self, address: NetworkAddress) -> bytes:
        self.addresses.append(address)
        return b"token %d" % len(self.addresses)


def connection_pair(configuration: QuicConfiguration) -> tuple[Peer, Peer, Issuer, list[bytes]]:
    received: list[bytes] = []
    client = Peer(client_quic(token_handler=received.append))
    server = Peer(server_quic(configuration, client))
    issuer = Issuer()
    send_new_token(server.quic, issuer)
    client.quic.connect(SERVER_ADDRESS, now=client.now)
    return client, server, issuer, received


def deliver(sender: Peer, receiver: Peer, source: NetworkAddress, drop: bool = False) -> None:
    for data, _ in sender.quic.datagrams_to_send(now=sender.now):
        if not drop:
            receiver.quic.receive_datagram(data, source, now=receiver.now)
    receiver.pump()


def sends_as_aioquic_alone(quic: QuicConnection) -> bool:
    method = quic._write_application
    return getattr(method, "__func__", None) is QuicConnection._write_application


def test_the_token_comes_with_the_servers_first_flight(
    server_configuration: QuicConfiguration,  # noqa: F811
) -> None:
    client, server, issuer, received = connection_pair(server_configuration)
    deliver(client, server, CLIENT_ADDRESS)
    deliver(server, client, SERVER_ADDRESS)
    assert received == [b"token 1"]  # before the client's Finished reached the server
    assert issuer.addresses == [CLIENT_ADDRESS]
    assert not sends_as_aioquic_alone(server.quic)
    exchange(client, server)
    assert received == [b"token 1"]
    assert sends_as_aioquic_alone(server.quic)  # acknowledged


def test_a_lost_token_is_sent_again(server_configuration: QuicConfiguration) -> None:  # noqa: F811
    client, server, issuer, received = connection_pair(server_configuration)
    deliver(client, server, CLIENT_ADDRESS)
    deliver(server, client, SERVER_ADDRESS, drop=True)  # the first flight, token included
    while not sends_as_aioquic_alone(server.quic):
        timer = server.quic.get_timer()
        assert timer is not None and timer < server.now + 10, "the server gave up"
        client.now = server.now = timer
        server.quic.handle_timer(now=timer)
        exchange(client, server)
    assert received == [b"token 2"]
    assert issuer.addresses == [CLIENT_ADDRESS] * 2
