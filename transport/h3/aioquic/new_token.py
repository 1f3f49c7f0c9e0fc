"""NEW_TOKEN frames from a server connection (RFC 9000 section 19.7), which aioquic 1.7.2
handles on clients but never sends.

The token rides in the server's first 1-RTT packet, with its answer to 0-RTT data and the
session ticket (transport/h3/aioquic/early_tickets.py), rather than after the client's Finished
(one round trip later): a client that closes once its first response arrives still holds it.
Sending it before the address is validated is as safe as a Retry's token: it goes to the
address the Initial came from, and only the peer that completes the handshake can read it (it
is encrypted with the 1-RTT keys), so whoever presents it later received packets at that
address. A token lost in transit is replaced by a fresh one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from aioquic.buffer import UINT_VAR_MAX_SIZE
from aioquic.quic.connection import NetworkAddress, QuicConnection
from aioquic.quic.packet import QuicFrameType, QuicPacketType
from aioquic.quic.packet_builder import (
    QuicDeliveryState,
    QuicPacketBuilder,
    QuicPacketBuilderStop,
)

from transport.h3.aioquic.connection import peer_address


def send_new_token(quic: QuicConnection, issue: Callable[[NetworkAddress], bytes]) -> None:
    """Put a NEW_TOKEN frame, holding `issue(client address)`, in the first 1-RTT packet this
    server connection sends, and again if that packet is lost; once one is acknowledged the
    connection sends as aioquic alone would."""
    write_application = quic._write_application
    pending = [True]

    def delivered(delivery: QuicDeliveryState) -> None:
        if delivery != QuicDeliveryState.ACKED:
            pending[0] = True
        elif quic.__dict__.get("_write_application") is write_with_token:  # not wrapped since
            quic._write_application = write_application  # type: ignore[method-assign]

    def write_with_token(builder: QuicPacketBuilder, network_path: Any, now: float) -> None:
        address = peer_address(quic)
        if not pending[0] or address is None:
            write_application(builder, network_path, now)
            return
        start_packet = builder.start_packet

        def start_with_token(packet_type: QuicPacketType, crypto: Any) -> None:
            start_packet(packet_type, crypto)
            if packet_type == QuicPacketType.ONE_RTT and pending[0]:
                with contextlib.suppress(QuicPacketBuilderStop):  # no room: the next packet
                    _write_frame(builder, issue(address), delivered)
                    pending[0] = False

        builder.start_packet = start_with_token  # type: ignore[method-assign]
        try:
            write_application(builder, network_path, now)
        finally:
            del builder.start_packet

    quic._write_application = write_with_token  # type: ignore[method-assign]


def _write_frame(
    builder: QuicPacketBuilder, token: bytes, delivered: Callable[[QuicDeliveryState], None]
) -> None:
    """Raises QuicPacketBuilderStop, having written nothing, when the packet has no room (the
    anti-amplification limit)."""
    buf = builder.start_frame(
        QuicFrameType.NEW_TOKEN,
        capacity=1 + UINT_VAR_MAX_SIZE + len(token),
        handler=delivered,
    )
    buf.push_uint_var(len(token))
    buf.push_bytes(token)
