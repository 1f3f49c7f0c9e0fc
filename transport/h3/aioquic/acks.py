"""ACKs that ride with stream data instead of packets of their own (aioquic's ACK timer
moved)."""

from __future__ import annotations

import weakref

from aioquic import tls
from aioquic.quic.connection import NetworkAddress, QuicConnection
from aioquic.quic.recovery import QuicPacketSpace


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


# Bytes of ack-eliciting datagrams held unacknowledged, per connection's 1-RTT space.
_held_bytes: weakref.WeakKeyDictionary[QuicPacketSpace, int] = weakref.WeakKeyDictionary()


def receive_datagram(quic: QuicConnection, data: bytes, addr: NetworkAddress, now: float) -> None:
    """aioquic's receive, with two rules on when a held ACK leaves at once.

    Bulk: an ack-eliciting datagram that arrives while an ACK is held back is acknowledged at
    once when the datagrams held reach a full-sized one's bytes, so a sender of large
    messages gets an ACK at least every second full datagram (RFC 9000 section 13.2.2, and
    TCP's every second full-sized segment) and is never kept waiting by `delay_acks`. Small
    ones (HANDSHAKE_DONE, a unary answer) wait for the delay: acknowledging every second one
    cost a connection that makes one call an ACK-only datagram before its CONNECTION_CLOSE,
    one more for each end to handle.

    Handshake: the receive that completes this end's handshake makes it send at once (a
    client's Finished, a server's HANDSHAKE_DONE), so a held ACK rides with that.

    aioquic sets `ack_at` only when an ack-eliciting packet arrives and none is set: clearing
    it for the receive tells whether this datagram held one (ACK-only packets and the
    handshake's Initial and Handshake packets, in other spaces, do not count)."""
    space = quic._spaces.get(tls.Epoch.ONE_RTT)
    held = None if space is None else space.ack_at
    completed = quic._handshake_complete
    if space is not None:
        space.ack_at = None
    quic.receive_datagram(data, addr, now=now)
    if space is None:
        return
    eliciting = space.ack_at is not None
    if eliciting:
        held_bytes = len(data) + (_held_bytes.get(space, 0) if held is not None else 0)
        _held_bytes[space] = held_bytes
        if held is not None:
            space.ack_at = now if held_bytes >= quic._max_datagram_size else held
    else:
        space.ack_at = held
    if space.ack_at is not None and quic._handshake_complete and not completed:
        space.ack_at = now
