"""ACKs that ride with stream data instead of packets of their own (aioquic's ACK timer
moved)."""

from __future__ import annotations

from aioquic import tls
from aioquic.quic.connection import NetworkAddress, QuicConnection


def ack_with_next_packet(quic: QuicConnection, now: float) -> None:
    """Let a pending ACK ride in the next packet. aioquic holds an ACK back until its delay
    (1 ms) expired even when it sends stream data before then, and then sends it in a packet
    of its own: a client that sends its next call right after an answer sent an ACK-only
    packet after each, one more packet for the server to receive per call."""
    space = quic._spaces.get(tls.Epoch.ONE_RTT)
    if space is not None and space.ack_at is not None and space.ack_at > now:
        space.ack_at = now


# How long an ACK may wait for data to ride with, below the max_ack_delay aioquic announces
# (25 ms), so the peer's loss detection already allows for it.
ACK_DELAY_S = 0.01


def delay_acks(quic: QuicConnection) -> None:
    """Hold ACKs back up to `ACK_DELAY_S` instead of aioquic's 1 ms. A unary call's answer
    takes a few milliseconds: with 1 ms the request's ACK left alone first (a timer, a
    transmit, one more datagram for each end to handle per call); now it rides with the
    answer. `receive_datagram` keeps bulk transfers acknowledged at once."""
    quic._ack_delay = ACK_DELAY_S


def receive_datagram(quic: QuicConnection, data: bytes, addr: NetworkAddress, now: float) -> None:
    """aioquic's receive, acknowledging at once an ack-eliciting packet that arrives while an
    ACK is already held back: every second one, as RFC 9000 section 13.2.2 advises, so a
    sender of many packets is never kept waiting by `delay_acks`.

    aioquic sets `ack_at` only when an ack-eliciting packet arrives and none is set: clearing
    it for the receive tells whether this datagram held one (ACK-only packets and the
    handshake's Initial and Handshake packets, in other spaces, do not count)."""
    space = quic._spaces.get(tls.Epoch.ONE_RTT)
    held = None if space is None else space.ack_at
    if space is not None:
        space.ack_at = None
    quic.receive_datagram(data, addr, now=now)
    if space is not None and held is not None:
        space.ack_at = held if space.ack_at is None else now
