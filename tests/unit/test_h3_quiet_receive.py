"""When a received datagram leaves aioquic nothing to send (quiet_receive.py), between two
in-memory aioquic connections driven as GrpcH3Protocol drives them: a receive builds packets
only when `nothing_to_send` says no, and that answer agrees with what aioquic then sends."""

from __future__ import annotations

import dataclasses

import pytest
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
from transport.h3.aioquic.acks import (
    ACK_DELAY_S,
    ack_with_next_packet,
    delay_acks,
    receive_datagram,
)
from transport.h3.aioquic.connection import set_max_concurrent_streams
from transport.h3.aioquic.credit import ReceiveCredit
from transport.h3.aioquic.quiet_receive import nothing_to_send

STREAM_LIMIT = 4
STREAM_WINDOW = 64 << 10


class Server(Peer):
    def __init__(self, quic: QuicConnection) -> None:
        super().__init__(quic)
        self.credit = ReceiveCredit(quic, STREAM_WINDOW, quic.configuration.max_data)
        self.transmits = 0

    def quiet(self) -> bool:
        return nothing_to_send(self.quic, self.credit, self.now)


@pytest.fixture
def peers(server_configuration: QuicConfiguration) -> tuple[Peer, Server]:  # noqa: F811
    client = Peer(client_quic())
    server = Server(
        server_quic(
            dataclasses.replace(server_configuration, max_stream_data=STREAM_WINDOW), client
        )
    )
    set_max_concurrent_streams(server.quic, STREAM_LIMIT)
    for peer in (client, server):
        delay_acks(peer.quic)
    client.quic.connect(SERVER_ADDRESS, now=1.0)
    exchange(client, server)
    return client, server


def deliver(sender: Peer, receiver: Peer) -> int:
    """What `sender` has to send, received by `receiver` as the protocol receives it; at the
    server, a receive builds packets only when `nothing_to_send` says there is something.
    The datagrams delivered."""
    sender.now = receiver.now = max(sender.now, receiver.now) + 0.001  # past aioquic's pacing
    datagrams = sender.quic.datagrams_to_send(now=sender.now)
    source = CLIENT_ADDRESS if sender.quic.configuration.is_client else SERVER_ADDRESS
    for data, _ in datagrams:
        receive_datagram(receiver.quic, data, source, receiver.now)
    receiver.pump()
    if isinstance(receiver, Server) and datagrams and not receiver.quiet():
        receiver.transmits += 1
        deliver(receiver, sender)
    return len(datagrams)


def request(client: Peer, size: int = 1000) -> int:
    """A new stream with a request; a pending ACK rides with it, as the protocol sends it."""
    stream_id = client.quic.get_next_available_stream_id()
    client.quic.send_stream_data(stream_id, b"x" * size, end_stream=True)
    ack_with_next_packet(client.quic, client.now)
    return stream_id


def test_a_lone_request_leaves_nothing_to_send(peers: tuple[Peer, Server]) -> None:
    client, server = peers
    request(client)
    assert deliver(client, server) == 1
    assert server.transmits == 0
    assert server.quic.datagrams_to_send(now=server.now) == []  # aioquic agrees


def test_an_ack_due_at_once_is_sent(peers: tuple[Peer, Server]) -> None:
    client, server = peers
    request(client, 2000)  # two datagrams: the second is acknowledged at once
    assert deliver(client, server) == 2
    assert server.transmits == 1


def test_a_held_ack_is_sent_when_its_timer_fires(peers: tuple[Peer, Server]) -> None:
    client, server = peers
    request(client)
    deliver(client, server)
    assert server.quic.get_timer() == pytest.approx(server.now + ACK_DELAY_S)
    server.now += ACK_DELAY_S
    server.quic.handle_timer(now=server.now)
    assert len(server.quic.datagrams_to_send(now=server.now)) == 1


def test_stream_data_waiting_is_something_to_send(peers: tuple[Peer, Server]) -> None:
    client, server = peers
    stream_id = request(client)
    deliver(client, server)
    server.quic.send_stream_data(stream_id, b"answer", end_stream=True)
    assert not server.quiet()


def test_calls_one_at_a_time_never_run_out_of_streams(peers: tuple[Peer, Server]) -> None:
    """Each request's packet acknowledges the answer before it, finishing that stream, but
    sends nothing; aioquic discards finished streams when it next builds packets, and then
    lets the peer open more (MAX_STREAMS), before the client has used up its streams."""
    client, server = peers
    for _ in range(5 * STREAM_LIMIT):
        stream_id = request(client)
        deliver(client, server)
        assert not client.quic._streams_blocked_bidi
        server.quic.send_stream_data(stream_id, b"answer", end_stream=True)
        deliver(server, client)
    assert server.transmits < 5 * STREAM_LIMIT  # most requests sent nothing


def test_streams_finished_by_an_ack_alone_let_the_peer_open_more(
    peers: tuple[Peer, Server],
) -> None:
    client, server = peers
    stream_ids = [request(client) for _ in range(STREAM_LIMIT)]
    deliver(client, server)
    for stream_id in stream_ids:
        server.quic.send_stream_data(stream_id, b"answer", end_stream=True)
    deliver(server, client)
    client.now += ACK_DELAY_S  # the client's ACK leaves alone, at its delay
    client.quic.handle_timer(now=client.now)
    transmits = server.transmits
    assert deliver(client, server) == 1
    assert server.transmits == transmits + 1  # MAX_STREAMS went out at once
    request(client)
    assert not client.quic._streams_blocked_bidi


def test_credit_is_worth_a_packet_only_in_batches(peers: tuple[Peer, Server]) -> None:
    """As the protocol accounts for it: what arrived is held until the call reads it."""
    client, server = peers
    for size, due in ((1000, False), (STREAM_WINDOW // 2 + 1000, True)):
        stream_id = request(client, size)
        server.credit.received(stream_id, size)
        while deliver(client, server):
            pass
        assert server.quiet()  # held: the peer may send no more than it did
        server.credit.consumed(stream_id, size)
        assert server.credit.due(stream_id) is due  # granted in batches of half the window
        assert server.quiet() is not due
