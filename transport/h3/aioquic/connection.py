"""A QuicConnection's private state that the protocols read or set: its stream limit, what a
stream holds unacknowledged, the peer's address, and early data lost to a Retry."""

from __future__ import annotations

from typing import Any

from aioquic import tls
from aioquic.quic.connection import NetworkAddress, QuicConnection


def send_buffered(quic: QuicConnection, stream_id: int) -> int:
    """Bytes written to a stream and not yet acknowledged by the peer."""
    stream = quic._streams.get(stream_id)
    return 0 if stream is None else len(stream.sender._buffer)


def set_max_concurrent_streams(quic: QuicConnection, limit: int) -> None:
    """aioquic hard-codes 128; must be called before the transport parameters are sent."""
    quic._local_max_streams_bidi.value = limit
    quic._local_max_streams_bidi.sent = limit


def resend_early_data_after_retry(quic: QuicConnection) -> None:
    """A client's 0-RTT data must be sent again after a Retry (the server dropped it with
    the Initial it answered with Retry). aioquic starts new packet spaces on Retry and drops
    the old ones' packets without reporting them lost, so their stream data was never sent
    again and the calls hung. Here they are reported lost: their data goes out again, as
    0-RTT with the new Initial."""
    receive_retry = quic._receive_retry_packet

    def receive_retry_packet(header: Any, packet_without_tag: bytes, now: float) -> None:
        retries = quic._retry_count
        old_space = quic._spaces.get(tls.Epoch.ONE_RTT)
        receive_retry(header, packet_without_tag, now)
        if quic._retry_count != retries and old_space is not None and old_space.sent_packets:
            quic._loss._on_packets_lost(
                congestion_event=False,
                now=now,
                packets=list(old_space.sent_packets.values()),
                space=old_space,
            )

    quic._receive_retry_packet = receive_retry_packet  # type: ignore[method-assign]


def peer_address(quic: QuicConnection) -> NetworkAddress | None:
    """The address the connection's packets come from, once one arrived."""
    paths = quic._network_paths
    return paths[0].addr if paths else None
