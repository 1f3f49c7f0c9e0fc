"""A NAT rebinding, emulated at the client: its QUIC connection goes on from a new UDP socket.

A NAT that forgets a mapping gives the client's next datagrams a new source port; the client
never learns it, and the server sees the same connection arrive from a new address. Moving
the connection to a fresh socket (a new port) does the same without a NAT: the old socket is
closed, so what the server still sends to the old port is lost, as behind the NAT."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from clients.quic_channel import QuicChannel


async def rebind(channel: QuicChannel) -> int:
    """Moves the channel's connection to a new UDP socket; returns its port. The kernel may
    hash the new address to another `--frontends` process than the old one."""
    protocol: Any = (await channel.connection()).protocol
    old = protocol._transport
    family = old.get_extra_info("socket").family  # aioquic's client binds "::" (dual stack)
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: protocol, local_addr=("::" if family == socket.AF_INET6 else "0.0.0.0", 0)
    )
    old.set_protocol(asyncio.DatagramProtocol())  # closing it must not end the connection
    old.close()
    return int(transport.get_extra_info("sockname")[1])
