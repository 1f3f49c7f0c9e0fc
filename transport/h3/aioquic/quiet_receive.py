"""Receives that give aioquic nothing to send skip its packet builder (aioquic's connection
state read, its protocol's timer re-armed).

aioquic's protocol builds packets after every datagram it receives: it starts a packet and
walks every stream (credit, stream data, finished streams), twice when it discards one. A lone
call's request packet gives it nothing to send: its ACK waits for the answer
(`acks.delay_acks`) and the call has not answered yet. That walk, a transmit for nothing per
call, was about a tenth of the server's CPU per call at one call at a time. `nothing_to_send`
reads the state that aioquic's `datagrams_to_send` writes packets from and says when it would
send nothing now; the receive then only re-arms the connection's timer (`arm_timer`), for the
held ACK, loss detection and the idle timeout. Anything left for later (a finished stream's
discard) goes with the next packet: the answer, or the held ACK when its timer fires.
"""

from __future__ import annotations

from aioquic import tls
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic.connection import QuicConnection, QuicConnectionState

from transport.h3.aioquic.credit import ReceiveCredit


def nothing_to_send(quic: QuicConnection, credit: ReceiveCredit, now: float) -> bool:
    """True when a packet built now would carry nothing: an established connection on one
    validated path with no ACK due, no control frame pending, no stream data, reset, stop or
    credit to send, and no MAX_STREAMS that discarding its finished streams would make due.
    Anything else (the handshake, closing, migration, loss recovery) transmits as before."""
    if (
        quic._state is not QuicConnectionState.CONNECTED
        or not quic._handshake_confirmed
        or quic._close_pending
        or quic._handshake_done_pending
        or quic._ping_pending
        or quic._probe_pending
        or quic._datagrams_pending
        or quic._retire_connection_ids
        or quic._streams_blocked_pending
        or (quic._is_client and quic._remote_preferred_address is not None)
    ):
        return False
    space = quic._spaces.get(tls.Epoch.ONE_RTT)
    if space is None or (space.ack_at is not None and space.ack_at <= now):
        return False
    paths = quic._network_paths
    if len(paths) != 1 or not paths[0].is_validated or paths[0].remote_challenges:
        return False
    if not quic._crypto_streams[tls.Epoch.ONE_RTT].sender.buffer_is_empty:
        return False
    if not all(connection_id.was_sent for connection_id in quic._host_cids):
        return False
    discarded_bidi = discarded_uni = 0
    for stream_id, stream in quic._streams.items():
        if stream.is_finished:
            if (not stream_id & 1) != quic._is_client:  # the peer opened it
                if stream_id & 2:
                    discarded_uni += 1
                else:
                    discarded_bidi += 1
            continue
        if (
            not stream.sender.buffer_is_empty
            or stream.sender.reset_pending
            or stream.receiver.stop_pending
            or credit.stream_due(stream)
        ):
            return False
    return not credit.connection_due(discarded_bidi, discarded_uni)


def arm_timer(protocol: QuicConnectionProtocol) -> None:
    """Re-arm the protocol's timer for the connection's next deadline, as aioquic's
    `QuicConnectionProtocol.transmit` does after sending."""
    timer_at = protocol._quic.get_timer()
    if protocol._timer is not None and protocol._timer_at != timer_at:
        protocol._timer.cancel()
        protocol._timer = None
    if protocol._timer is None and timer_at is not None:
        protocol._timer = protocol._loop.call_at(timer_at, protocol._handle_timer)
    protocol._timer_at = timer_at
