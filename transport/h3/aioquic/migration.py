"""What a server sent to a client's old address goes again to its new one at once."""

from __future__ import annotations

from aioquic import tls
from aioquic.quic.connection import NetworkAddress, QuicConnection


def resend_after_migration(quic: QuicConnection) -> None:
    """A server learns a client's new address (a NAT rebinding, a move to another network)
    from the client's first packet from there. What it sent to the old address meanwhile is
    lost, and aioquic sends it again only on its probe timeout, which the probes sent to the
    old address have backed off (the migration lab's typical move at 20 ms RTT: 103-154 ms
    without this, 74-107 ms with it). Here the ack-eliciting packets in flight when the
    address changes are reported lost at once, not as a congestion event (as a probe timeout
    does), so their data goes to the new address with the PATH_CHALLENGE, within the
    anti-amplification limit until it is validated. Only a packet numbered above every one
    received moves the connection (aioquic), so a replayed packet cannot trigger this."""
    receive = quic.receive_datagram

    def receive_datagram(data: bytes, addr: NetworkAddress, now: float) -> None:
        paths = quic._network_paths
        before = paths[0].addr if paths else None
        receive(data, addr, now)
        space = quic._spaces.get(tls.Epoch.ONE_RTT)
        paths = quic._network_paths
        if before is None or space is None or not paths or paths[0].addr == before:
            return
        sent = [packet for packet in space.sent_packets.values() if packet.is_ack_eliciting]
        if sent:
            quic._loss._on_packets_lost(congestion_event=False, now=now, packets=sent, space=space)

    quic.receive_datagram = receive_datagram  # type: ignore[method-assign]
