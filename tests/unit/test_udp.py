"""transport.h3.udp: the HTTP/3 server's socket, read in bounded bursts without blocking."""

from __future__ import annotations

import socket

from transport.h3 import udp


def test_burst_reads_what_is_queued_up_to_the_limit_and_never_blocks() -> None:
    server = udp.bind("127.0.0.1", 0)
    address = server.getsockname()
    with server, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
        assert not server.getblocking()
        assert list(udp.queued(server, 8)) == []  # empty: returns at once
        for i in range(3):  # loopback queues a datagram before sendto returns
            client.sendto(b"datagram %d" % i, address)
        first = [data for data, _ in udp.queued(server, 2)]
        rest = [(data, peer) for data, peer in udp.queued(server, 8)]
        assert first == [b"datagram 0", b"datagram 1"]
        assert [data for data, _ in rest] == [b"datagram 2"]
        assert rest[0][1][1] == client.getsockname()[1]  # the sender, for the answer
        assert list(udp.queued(server, 8)) == []


def test_bind_reports_an_address_in_use() -> None:
    with udp.bind("127.0.0.1", 0) as taken:
        try:
            udp.bind("127.0.0.1", taken.getsockname()[1]).close()
        except OSError:
            return
        raise AssertionError("a second socket bound the same UDP port")
