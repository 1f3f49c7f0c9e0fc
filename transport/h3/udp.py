"""The HTTP/3 server's UDP socket, read in bursts.

asyncio's datagram transport reads one datagram per event-loop turn, and after each one
aioquic builds a transmit, which walks every stream of the connection even when it has nothing
to send. Under load datagrams queue up in the socket: reading the ones already there in the
same turn lets one transmit per connection answer all of them (ACKs, credit, responses).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

MAX_BURST = 64  # datagrams read in one turn: bounded, so timers and other sockets still run
RECEIVE_BUFFER = 4 << 20  # bytes; Linux caps it at net.core.rmem_max
_MAX_DATAGRAM = 65536


def enlarge_receive_buffer(sock: Any) -> None:
    """Room for bursts. Linux's default receive buffer (208 KiB, each datagram charged about
    twice its size) overflows when 64 callers send at once; a dropped datagram costs a
    retransmission after a timeout. `sock`: a socket or asyncio's TransportSocket."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A non-blocking UDP socket bound to the first address `host` resolves to that binds.
    `reuse_port`: SO_REUSEPORT, so several processes share the port (the kernel spreads
    datagrams among them by their addresses)."""
    error: OSError | None = None
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE)
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            enlarge_receive_buffer(sock)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        return sock
    raise error or OSError(f"cannot bind UDP on {host}:{port}")


def queued(sock: socket.socket, limit: int) -> Iterator[tuple[bytes, Any]]:
    """The datagrams already waiting in `sock`, at most `limit`; never blocks. A socket error
    (e.g. an ICMP error reported for an earlier datagram) ends the burst: asyncio's transport
    reads the socket again on the next turn."""
    for _ in range(limit):
        try:
            yield sock.recvfrom(_MAX_DATAGRAM)
        except OSError:  # BlockingIOError when the socket is empty
            return
