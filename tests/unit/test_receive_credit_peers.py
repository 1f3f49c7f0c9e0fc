"""ReceiveCredit on a real aioquic server talking to a real aioquic client in memory: the
credit the client sees (MAX_STREAM_DATA, MAX_DATA, as the client parsed them) follows what
the server's application consumed, the oldest message in progress gets the window it needs
and then hands it on, and a stopped stream gets nothing more. `make mutate` found no test
reaching these lines of transport/h3/aioquic/credit.py."""

from __future__ import annotations

import dataclasses

import pytest
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
from transport.h3.aioquic.connection import set_max_concurrent_streams
from transport.h3.aioquic.credit import FRAMING_SLACK, ReceiveCredit

WINDOW = 64 << 10
BATCH = WINDOW // 2  # ReceiveCredit grants stream credit in half windows
CONNECTION_WINDOW = 4 * WINDOW
STREAM_LIMIT = 4


class Server(Peer):
    """The server end, whose application holds every byte that arrives on a request stream
    until the test says it consumed them (as GrpcH3Protocol reports what its streams hold),
    or, with `hold` off, takes each byte as it arrives."""

    def __init__(self, quic: QuicConnection) -> None:
        super().__init__(quic)
        self.credit = ReceiveCredit(quic, WINDOW, CONNECTION_WINDOW)
        self.hold = True

    def pump(self) -> None:
        while (event := self.quic.next_event()) is not None:
            if not isinstance(event, events.StreamDataReceived):
                assert not isinstance(event, events.ConnectionTerminated), event
            elif self.hold and not event.stream_id & 2:  # a request stream
                self.credit.received(event.stream_id, len(event.data))


@pytest.fixture
def peers(server_configuration: QuicConfiguration) -> tuple[Peer, Server]:  # noqa: F811
    configuration = dataclasses.replace(
        server_configuration, max_stream_data=WINDOW, max_data=CONNECTION_WINDOW
    )
    client = Peer(client_quic())
    client.quic.connect(SERVER_ADDRESS, now=1.0)
    server = Server(server_quic(configuration, client))
    set_max_concurrent_streams(server.quic, STREAM_LIMIT)
    exchange(client, server)
    return client, server


def send(client: Peer, server: Server, size: int) -> int:
    """A new stream on which the client sends `size` bytes, as far as its credit lets it."""
    stream_id = client.quic.get_next_available_stream_id()
    client.quic.send_stream_data(stream_id, b"x" * size)
    settle(client, server)
    return stream_id


def settle(client: Peer, server: Server) -> None:
    """Datagrams both ways until neither side has anything to send; the client must have
    parsed every frame the server sent."""
    exchange(client, server)
    assert not client.terminated


def stream_credit(client: Peer, stream_id: int) -> int:
    """What the client may send on the stream: the last MAX_STREAM_DATA it received."""
    return client.quic._streams[stream_id].max_stream_data_remote


def arrived(server: Server, stream_id: int) -> int:
    return server.quic._streams[stream_id].receiver.highest_offset


def test_stream_credit_is_granted_in_half_windows_of_what_was_consumed(
    peers: tuple[Peer, Server],
) -> None:
    client, server = peers
    stream_id = send(client, server, 3 * WINDOW)
    assert arrived(server, stream_id) == stream_credit(client, stream_id) == WINDOW
    server.credit.consumed(stream_id, BATCH - 1)
    assert not server.credit.due(stream_id)  # less than a batch: not worth a packet
    settle(client, server)
    assert stream_credit(client, stream_id) == WINDOW
    server.credit.consumed(stream_id, 1)
    assert server.credit.due(stream_id)
    settle(client, server)
    assert stream_credit(client, stream_id) == WINDOW + BATCH  # consumed + the window
    assert arrived(server, stream_id) == WINDOW + BATCH
    assert not server.credit.due(stream_id)  # sent: nothing more is due


def test_a_stream_whose_data_is_taken_as_it_arrives_gets_the_window_beyond_it(
    peers: tuple[Peer, Server],
) -> None:
    """Small messages taken whole as they arrive are never held: the credit is what arrived
    plus the window, from the first batch on."""
    client, server = peers
    server.hold = False
    stream_id = send(client, server, BATCH)
    assert stream_credit(client, stream_id) == BATCH + WINDOW


def test_a_unidirectional_stream_keeps_aioquics_credit(peers: tuple[Peer, Server]) -> None:
    """HTTP/3's own streams (control, QPACK) are read by the H3 layer as they arrive:
    aioquic's rule (the limit doubles once half of it arrived) still grants their credit."""
    client, server = peers
    stream_id = client.quic.get_next_available_stream_id(is_unidirectional=True)
    client.quic.send_stream_data(stream_id, b"x" * (BATCH + 1))
    settle(client, server)
    assert arrived(server, stream_id) == BATCH + 1
    assert stream_credit(client, stream_id) == 2 * WINDOW


def test_a_stopped_stream_gets_no_more_credit(peers: tuple[Peer, Server]) -> None:
    client, server = peers
    stopped, read = send(client, server, 2 * WINDOW), send(client, server, 2 * WINDOW)
    server.credit.stop(stopped)  # what it held is freed, and no reader will take more
    server.credit.consumed(read, WINDOW)
    settle(client, server)
    assert (stream_credit(client, stopped), stream_credit(client, read)) == (WINDOW, 2 * WINDOW)


def test_a_waiting_reader_unblocks_a_message_larger_than_the_window(
    peers: tuple[Peer, Server],
) -> None:
    """The reader holds a partial message and waits for the rest: its stream's window grows
    to the message plus the framing slack at once, not a batch later."""
    client, server = peers
    message = 3 * WINDOW // 2
    stream_id = send(client, server, message)
    server.credit.message_in_progress(stream_id, message)
    assert server.credit.due(stream_id)
    settle(client, server)
    # received - held + (message + slack): the whole message and its framing fit
    assert stream_credit(client, stream_id) == message + FRAMING_SLACK
    assert arrived(server, stream_id) == message


def test_a_reader_holding_its_message_and_the_slack_at_most_waits_for_the_rest(
    peers: tuple[Peer, Server],
) -> None:
    """With less than the framing slack left to the peer, a stream that holds no more than
    its message in progress plus the slack gets credit at once, below a batch; one byte
    more held and the reader has something to take: the credit waits for the batch."""
    client, server = peers
    message = 20 << 10
    stream_id = send(client, server, WINDOW - (4 << 10))  # 4 KiB left: less than the slack
    server.credit.message_in_progress(stream_id, message)
    sent = arrived(server, stream_id)
    server.credit.consumed(stream_id, sent - (message + FRAMING_SLACK) - 1)
    settle(client, server)
    assert stream_credit(client, stream_id) == WINDOW
    server.credit.consumed(stream_id, 1)
    settle(client, server)
    assert stream_credit(client, stream_id) == sent - (message + FRAMING_SLACK) + WINDOW
    assert stream_credit(client, stream_id) - WINDOW < BATCH


@pytest.mark.parametrize("turn_ends", ["message_in_progress", "stop", "forget"])
def test_only_the_oldest_message_in_progress_grows_its_window_until_its_turn_ends(
    peers: tuple[Peer, Server], turn_ends: str
) -> None:
    """Two streams each hold the start of a message twice the window: the first gets the
    window its message needs, the second keeps its own until the first's message completes,
    its stream is stopped or its call is over."""
    client, server = peers
    message = 2 * WINDOW
    first, second = send(client, server, message), send(client, server, message)
    server.credit.message_in_progress(first, message)
    server.credit.message_in_progress(second, message)
    settle(client, server)
    assert stream_credit(client, first) == message + FRAMING_SLACK
    assert stream_credit(client, second) == WINDOW
    if turn_ends == "message_in_progress":
        server.credit.consumed(first, message)
        server.credit.message_in_progress(first, 0)  # complete: taken whole
    else:
        getattr(server.credit, turn_ends)(first)
    settle(client, server)
    assert stream_credit(client, second) == message + FRAMING_SLACK
    assert arrived(server, second) == message


def test_connection_credit_follows_what_the_streams_hold(peers: tuple[Peer, Server]) -> None:
    """Streams that hold the whole connection window block the client; consuming on one of
    them grants what was consumed (MAX_DATA: received - held + the window) at once, since
    the client has nothing left, and once granted nothing more is due."""
    client, server = peers
    first = send(client, server, 3 * WINDOW)
    for _ in range(STREAM_LIMIT - 1):
        send(client, server, WINDOW)
    assert client.quic._remote_max_data == server.quic._local_max_data.used == CONNECTION_WINDOW
    assert arrived(server, first) == WINDOW
    server.credit.consumed(first, WINDOW)
    assert server.credit.connection_due(0, 0)
    settle(client, server)
    assert client.quic._remote_max_data == CONNECTION_WINDOW + WINDOW
    assert arrived(server, first) == 2 * WINDOW
    assert not server.credit.connection_due(0, 0)


def test_connection_credit_is_granted_in_half_windows_while_the_client_has_room(
    peers: tuple[Peer, Server],
) -> None:
    """Far from its limit, the client gets more connection credit (MAX_DATA) once half the
    connection window was consumed, not a byte before."""
    client, server = peers
    first, second = send(client, server, WINDOW), send(client, server, WINDOW)
    half = CONNECTION_WINDOW // 2
    assert server.quic._local_max_data.used == half  # half the window left to the client
    server.credit.consumed(first, WINDOW)
    server.credit.consumed(second, WINDOW - 1)
    settle(client, server)
    assert client.quic._remote_max_data == CONNECTION_WINDOW
    server.credit.consumed(second, 1)
    settle(client, server)
    assert client.quic._remote_max_data == CONNECTION_WINDOW + half


def test_max_streams_raises_are_batched_as_aioquic_batches_them(
    peers: tuple[Peer, Server],
) -> None:
    """A finished stream lets the client open one more, announced once it has fewer left
    than the raise would add: not after the first finished stream, later in one frame."""
    client, server = peers
    announced = []
    for _ in range(STREAM_LIMIT - 1):
        stream_id = client.quic.get_next_available_stream_id()
        client.quic.send_stream_data(stream_id, b"request", end_stream=True)
        settle(client, server)
        server.quic.send_stream_data(stream_id, b"answer", end_stream=True)
        settle(client, server)
        settle(client, server)  # the server discards the stream as it builds its next packet
        announced.append(client.quic._remote_max_streams_bidi)
    assert announced[0] == STREAM_LIMIT
    assert announced[-1] > STREAM_LIMIT


def test_the_promoted_message_is_not_held_back_by_what_other_streams_hold(
    peers: tuple[Peer, Server],
) -> None:
    """Other streams hold the whole connection window; the oldest message in progress still
    gets connection credit for all of it."""
    client, server = peers
    message = 3 * WINDOW
    promoted = send(client, server, message)
    others = [send(client, server, WINDOW) for _ in range(3)]
    assert arrived(server, promoted) == WINDOW and server.credit.unconsumed == 4 * WINDOW
    server.credit.message_in_progress(promoted, message)
    settle(client, server)
    assert arrived(server, promoted) == message
    assert server.credit.unconsumed == message + 3 * WINDOW  # nothing consumed: all held
    assert client.quic._remote_max_data == CONNECTION_WINDOW + message + FRAMING_SLACK
    assert all(arrived(server, stream_id) == WINDOW for stream_id in others)


def test_max_streams_is_due_once_finished_streams_outnumber_what_the_peer_has_left(
    peers: tuple[Peer, Server],
) -> None:
    """aioquic's batching of MAX_STREAMS: with every stream the client may open in use,
    one stream discarded makes the raise due; with one left to open, two must be; for
    unidirectional streams, one more than the client has left."""
    client, server = peers
    for _ in range(STREAM_LIMIT - 1):
        send(client, server, 10)
    assert not server.credit.connection_due(1, 0)  # 1 left to open, a raise of 1
    assert server.credit.connection_due(2, 0)
    stream_id = send(client, server, 10)
    assert not server.credit.connection_due(0, 0)
    assert not server.credit.due(stream_id)  # nothing consumed, no stream discarded
    assert server.credit.connection_due(1, 0)
    uni = server.quic._local_max_streams_uni
    while uni.used < uni.sent:  # every unidirectional stream the client may open
        client.quic.send_stream_data(client.quic.get_next_available_stream_id(True), b"u")
        settle(client, server)
    assert not server.credit.connection_due(0, 0)
    assert not server.credit.due(stream_id)
    assert server.credit.connection_due(0, 1)


def test_a_unidirectional_stream_is_due_by_aioquics_rule(peers: tuple[Peer, Server]) -> None:
    """What `due` says for such a stream is what aioquic's writer then does: nothing at
    exactly half its limit, a raise one byte past it."""
    client, server = peers
    stream_id = client.quic.get_next_available_stream_id(is_unidirectional=True)
    client.quic.send_stream_data(stream_id, b"x" * BATCH)
    settle(client, server)
    stream = server.quic._streams[stream_id]
    assert stream_credit(client, stream_id) == WINDOW and not server.credit.stream_due(stream)
    client.quic.send_stream_data(stream_id, b"x")
    client.now = server.now = client.now + 0.01  # past aioquic's pacing
    for data, _ in client.quic.datagrams_to_send(now=client.now):  # to the server only
        server.quic.receive_datagram(data, CLIENT_ADDRESS, now=server.now)
    server.pump()
    assert arrived(server, stream_id) == BATCH + 1 and server.credit.stream_due(stream)
    settle(client, server)
    assert stream_credit(client, stream_id) == 2 * WINDOW
    assert not server.credit.stream_due(stream)


@pytest.mark.parametrize("opened_by", ["client", "server"])
def test_stream_due_agrees_with_the_packet_whoever_opened_the_stream(
    peers: tuple[Peer, Server], opened_by: str
) -> None:
    """More than half a window arrived and is all held: aioquic's own rule would grant
    credit, ReceiveCredit's does not, and `due` (what quiet_receive asks) says what the next
    packet then carries: nothing, for a bidirectional stream either side opened."""
    client, server = peers
    if opened_by == "server":
        stream_id = server.quic.get_next_available_stream_id()
        server.quic.send_stream_data(stream_id, b"opened")
        settle(client, server)
    else:
        stream_id = client.quic.get_next_available_stream_id()
    client.quic.send_stream_data(stream_id, b"x" * (BATCH + 1))
    settle(client, server)
    assert arrived(server, stream_id) == BATCH + 1
    assert not server.credit.due(stream_id)
    settle(client, server)
    assert stream_credit(client, stream_id) == WINDOW
