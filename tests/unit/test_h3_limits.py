"""HTTP/3 memory bounds without sockets: a stream's state and the H3 layer's header block
limit, the latter between two real aioquic connections exchanging datagrams in memory."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import grpc
import pytest
from aioquic.h3.connection import H3_ALPN
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from transport.grpc.framing import HEADER_SIZE, encode_message
from transport.grpc.headers import field_section_size
from transport.h3.aioquic import PINNED_VERSION, check_version
from transport.h3.aioquic.h3_connection import GrpcH3Connection
from transport.h3.stream_state import StreamState
from transport.tls.certs import ensure_dev_certificates

LIMIT = 16 << 10
CLIENT_ADDRESS = ("192.0.2.1", 4433)
SERVER_ADDRESS = ("192.0.2.2", 443)
REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"https"),
    (b":authority", b"localhost"),
    (b":path", b"/paddlequic.v1.Testing/Unary"),
    (b"content-type", b"application/grpc"),
]


# StreamState: what a stream holds, and the status a malformed one fails with


def test_a_partial_message_is_held_until_taken() -> None:
    state = StreamState(max_message=1 << 20)
    wire = encode_message(b"x" * 1000)
    assert state.data_received(wire[:600], ended=False)
    assert state.held == 600  # partial: it holds credit too
    assert state.in_progress == len(wire)
    assert state.data_received(wire[600:], ended=False)
    assert state.held == len(wire) and state.in_progress == 0
    assert state.take_message() == b"x" * 1000
    assert state.held == 0
    assert state.take_message() is None


def test_an_oversized_message_fails_as_soon_as_its_prefix_arrives() -> None:
    state = StreamState(max_message=1 << 20)
    prefix = encode_message(b"")[:1] + (100 << 20).to_bytes(4, "big")
    assert not state.data_received(prefix, ended=False)
    assert state.error is not None
    assert state.error.status is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "104857600" in state.error.message
    assert state.in_progress == 0
    # What the peer sends after that is dropped, not buffered.
    assert not state.data_received(b"y" * 4096, ended=False)
    assert state.held <= HEADER_SIZE


def test_a_compressed_message_without_an_encoding_is_unimplemented() -> None:
    state = StreamState(max_message=1 << 20)
    assert not state.data_received(b"\x01\x00\x00\x00\x02ab", ended=False)
    assert state.error is not None and state.error.status is grpc.StatusCode.UNIMPLEMENTED


def test_a_truncated_message_is_internal() -> None:
    state = StreamState(max_message=1 << 20)
    assert state.data_received(encode_message(b"abcdef")[:-2], ended=False)
    assert not state.data_received(b"", ended=True)
    assert state.error is not None and state.error.status is grpc.StatusCode.INTERNAL
    assert state.ended


def test_trailers_after_messages() -> None:
    state = StreamState(max_message=1 << 20)
    state.headers_received([(b":status", b"200")], ended=False)
    state.data_received(encode_message(b"a") + encode_message(b"b"), ended=False)
    state.headers_received([(b"grpc-status", b"0")], ended=True)
    assert state.error is None and state.ended
    assert state.trailers == [(b"grpc-status", b"0")]
    assert [state.take_message(), state.take_message()] == [b"a", b"b"]


def test_only_the_pinned_aioquic_is_accepted() -> None:
    check_version(PINNED_VERSION)
    with pytest.raises(ImportError, match=r"aioquic==1\.7\.2 exactly.*1\.8\.0 is installed"):
        check_version("1.8.0")


# GrpcH3Connection: SETTINGS_MAX_FIELD_SECTION_SIZE between two in-memory connections


class Peer:
    def __init__(self, quic: QuicConnection) -> None:
        self.quic = quic
        self.h3: GrpcH3Connection | None = None
        self.refused: list[tuple[int, int]] = []
        self.buffered_peak = 0
        self.h3_events: list[H3Event] = []
        self.terminated = False
        self.now = 1.0

    def start_h3(self) -> None:
        self.h3 = GrpcH3Connection(
            self.quic,
            max_field_section=LIMIT,
            on_goaway=lambda stream_id: None,
            on_too_large=lambda stream_id, size: self.refused.append((stream_id, size)),
            on_buffered=self._buffered,
        )

    def _buffered(self, stream_id: int, size: int) -> None:
        self.buffered_peak = max(self.buffered_peak, size)

    def pump(self) -> None:
        while (event := self.quic.next_event()) is not None:
            if isinstance(event, events.ConnectionTerminated):
                self.terminated = True
            if self.h3 is not None:
                self.h3_events.extend(self.h3.handle_event(event))


def client_quic(**options: Any) -> QuicConnection:
    """A client connection that accepts any certificate (no CA is loaded here)."""
    configuration = QuicConfiguration(
        is_client=True, alpn_protocols=H3_ALPN, verify_mode=ssl.CERT_NONE
    )
    return QuicConnection(configuration=configuration, **options)


def server_quic(configuration: QuicConfiguration, client: Peer, **options: Any) -> QuicConnection:
    """The server end of `client`'s connection."""
    return QuicConnection(
        configuration=configuration,
        original_destination_connection_id=client.quic.original_destination_connection_id,
        **options,
    )


@pytest.fixture(scope="module")
def server_configuration(tmp_path_factory: pytest.TempPathFactory) -> QuicConfiguration:
    certs, _ = ensure_dev_certificates(Path(tmp_path_factory.mktemp("certs")))
    configuration = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    configuration.load_cert_chain(certs.server_cert, certs.server_key)
    return configuration


def exchange(client: Peer, server: Peer) -> None:
    """Deliver datagrams both ways until neither side has anything to send. The clock moves
    on every round, or aioquic's pacing would hold datagrams back."""
    while True:
        client.now += 0.01
        now = server.now = client.now
        moved = False
        for sender, receiver, source in (
            (client, server, CLIENT_ADDRESS),
            (server, client, SERVER_ADDRESS),
        ):
            for data, _ in sender.quic.datagrams_to_send(now=now):
                receiver.quic.receive_datagram(data, source, now=now)
                moved = True
            receiver.pump()
        if not moved:
            return


@pytest.fixture
def peers(server_configuration: QuicConfiguration) -> tuple[Peer, Peer]:
    client = Peer(client_quic())
    client.quic.connect(SERVER_ADDRESS, now=1.0)
    server = Peer(server_quic(server_configuration, client))
    exchange(client, server)
    client.start_h3()
    server.start_h3()
    exchange(client, server)
    return client, server


def requests_seen(server: Peer) -> list[int]:
    return [e.stream_id for e in server.h3_events if isinstance(e, HeadersReceived)]


def test_the_limit_is_advertised_in_settings(peers: tuple[Peer, Peer]) -> None:
    client, server = peers
    assert client.h3 is not None and client.h3.peer_max_field_section == LIMIT
    assert server.h3 is not None and server.h3.peer_max_field_section == LIMIT


def test_a_header_block_at_the_limit_is_accepted(peers: tuple[Peer, Peer]) -> None:
    client, server = peers
    assert client.h3 is not None
    room = LIMIT - field_section_size(REQUEST) - 32 - len(b"x-pad")
    headers = [*REQUEST, (b"x-pad", b"p" * room)]
    assert field_section_size(headers) == LIMIT
    stream_id = client.quic.get_next_available_stream_id()
    client.h3.send_headers(stream_id, headers, end_stream=True)
    exchange(client, server)
    assert requests_seen(server) == [stream_id] and not server.refused


def test_a_large_encoded_block_is_refused_before_it_is_buffered(
    peers: tuple[Peer, Peer],
) -> None:
    client, server = peers
    assert client.h3 is not None
    bomb = client.quic.get_next_available_stream_id()
    # Bytes that Huffman coding cannot shrink much: the encoded frame alone is over the limit.
    pad = bytes(range(33, 127)) * 10
    client.h3.send_headers(bomb, [*REQUEST, *[(b"x-bomb-%d" % i, pad) for i in range(40)]])
    exchange(client, server)
    assert [stream_id for stream_id, _ in server.refused] == [bomb]
    assert server.buffered_peak <= LIMIT  # never more than the limit of the block was held
    assert requests_seen(server) == []
    # The stream's later data is dropped; the connection and its other streams go on.
    client.h3.send_data(bomb, encode_message(b"ignored"), end_stream=True)
    fine = client.quic.get_next_available_stream_id()
    client.h3.send_headers(fine, REQUEST)
    client.h3.send_data(fine, encode_message(b"served"), end_stream=True)
    exchange(client, server)
    assert requests_seen(server) == [fine]
    data = [e for e in server.h3_events if isinstance(e, DataReceived)]
    assert {e.stream_id for e in data} == {fine}
    assert b"".join(e.data for e in data) == encode_message(b"served")
    assert not server.terminated and not client.terminated


def test_a_small_block_that_decodes_too_large_is_refused(peers: tuple[Peer, Peer]) -> None:
    """QPACK can make a block decode to much more than its encoded size: the decoded size
    (names, values and 32 per field) is checked too."""
    client, server = peers
    assert client.h3 is not None
    stream_id = client.quic.get_next_available_stream_id()
    headers = [*REQUEST, *[(b"x-k", b"v")] * 600]
    assert field_section_size(headers) > LIMIT
    client.h3.send_headers(stream_id, headers, end_stream=True)
    exchange(client, server)
    assert [refused for refused, _ in server.refused] == [stream_id]
    assert requests_seen(server) == [] and not server.terminated


def test_header_blocks_write_nothing_on_the_qpack_streams(peers: tuple[Peer, Peer]) -> None:
    """Without a dynamic table neither end has QPACK instructions to send: a request and its
    answer are written on their request stream only."""
    client, server = peers
    assert client.h3 is not None and server.h3 is not None
    written: list[int] = []
    for peer in (client, server):
        record_writes(peer.quic, written)
    stream_id = client.quic.get_next_available_stream_id()
    client.h3.send_headers(stream_id, REQUEST, end_stream=True)
    exchange(client, server)
    assert requests_seen(server) == [stream_id]
    server.h3.send_headers(stream_id, [(b":status", b"200")], end_stream=True)
    exchange(client, server)
    assert [e.headers for e in client.h3_events if isinstance(e, HeadersReceived)] == [
        [(b":status", b"200")]
    ]
    assert written == [stream_id, stream_id]


def record_writes(quic: QuicConnection, written: list[int]) -> None:
    """Append the stream of every write to `written`, then write."""
    send = quic.send_stream_data

    def record(stream_id: int, data: bytes, end_stream: bool = False) -> None:
        written.append(stream_id)
        send(stream_id, data, end_stream)

    quic.send_stream_data = record  # type: ignore[method-assign]
