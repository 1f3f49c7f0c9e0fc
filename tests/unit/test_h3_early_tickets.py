"""Session tickets sent with the server's Finished: between two in-memory aioquic connections,
the client holds its next ticket as soon as it can complete the handshake, before the server
heard its Finished; the ticket resumes with 0-RTT, and each connection gets exactly one."""

from __future__ import annotations

import ssl

from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.tls import SessionTicket

from tests.unit.test_h3_limits import (
    CLIENT_ADDRESS,
    SERVER_ADDRESS,
    Peer,
    exchange,
    server_configuration,  # noqa: F401  # the fixture
    server_quic,
)
from transport.h3.aioquic.early_tickets import issue_tickets_with_finished
from transport.tls.session_tickets import MemoryTicketStore


def connect(
    configuration: QuicConfiguration, store: MemoryTicketStore, ticket: SessionTicket | None
) -> tuple[Peer, Peer, list[SessionTicket]]:
    """A client (resuming from `ticket` when given, with a request as early data) and a
    server whose first flight has been delivered: the client's Finished has not reached the
    server yet. Returns the tickets the client received so far (the list grows later)."""
    received: list[SessionTicket] = []
    client = Peer(
        QuicConnection(
            configuration=QuicConfiguration(
                is_client=True,
                alpn_protocols=H3_ALPN,
                verify_mode=ssl.CERT_NONE,
                server_name="localhost",
                session_ticket=ticket,
            ),
            session_ticket_handler=received.append,
        )
    )
    server = Peer(
        server_quic(
            configuration,
            client,
            session_ticket_fetcher=store.pop,
            session_ticket_handler=store.add,
        )
    )
    issue_tickets_with_finished(server.quic)
    client.quic.connect(SERVER_ADDRESS, now=1.0)
    if ticket is not None:
        client.quic.send_stream_data(0, b"early request", end_stream=True)
    for sender, receiver, source in (
        (client, server, CLIENT_ADDRESS),
        (server, client, SERVER_ADDRESS),
    ):
        for data, _ in sender.quic.datagrams_to_send(now=1.0):
            receiver.quic.receive_datagram(data, source, now=1.0)
        receiver.pump()
    return client, server, received


def test_the_ticket_comes_with_the_servers_finished(
    server_configuration: QuicConfiguration,  # noqa: F811
) -> None:
    store = MemoryTicketStore()
    client, server, received = connect(server_configuration, store, None)
    assert not server.quic._handshake_complete  # the client's Finished is still on its way
    assert len(received) == 1 and store.counters.issued == 1
    exchange(client, server)
    assert server.quic._handshake_complete
    assert len(received) == 1 and store.counters.issued == 1  # not a second one at Finished


def test_a_ticket_sent_with_finished_resumes_with_early_data_and_brings_the_next(
    server_configuration: QuicConfiguration,  # noqa: F811
) -> None:
    store = MemoryTicketStore()
    client, server, (ticket,) = connect(server_configuration, store, None)
    exchange(client, server)
    # The server derived the ticket's secret before the client's Finished arrived: the PSK
    # binder the client computes from its own copy must match it for the resumption to work.
    resumed_client, resumed_server, received = connect(server_configuration, store, ticket)
    assert len(received) == 1  # the next ticket, with the resumed handshake
    exchange(resumed_client, resumed_server)
    assert resumed_server.quic.tls.session_resumed
    assert resumed_server.quic.tls.early_data_accepted
    assert store.counters.redeemed == 1 and store.counters.issued == 2
    assert len(received) == 1
