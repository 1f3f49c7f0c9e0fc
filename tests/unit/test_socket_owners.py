"""Who owns a socket of this host (service/inference/socket_owners.py): /proc/net tables as
the kernel prints them, the address forms a peer can take (IPv4-mapped, wildcard UDP), and
the live tables for sockets this test makes."""

# ruff: noqa: E501 (the samples are the kernel's lines as it prints them)

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.inference.socket_owners import (
    connected_owner,
    exact_owner,
    owners,
    parse_table,
    socket_owner,
)

V4 = ipaddress.IPv4Address
V6 = ipaddress.IPv6Address

TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 36927 1
   1: 0100007F:A6DE 0100007F:1F41 01 00000000:00000000 00:00000000 00000000  1000        0 33765 1
   2: 0100007F:A6E2 0100007F:1F41 06 00000000:00000000 03:00001282 00000000     0        0 0 3
   3: 0100007F:A700 0100007F:1F41 01 00000000:00000000 00:00000000 00000000  1000        0 7 1
   4: 0100007F:A700 0200007F:1F41 01 00000000:00000000 00:00000000 00000000  1001        0 8 1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:B000 00000000000000000000000001000000:1F41 01 00000000:00000000 00:00000000 00000000 65534        0 1 1
   1: 0000000000000000FFFF00000100007F:B001 0000000000000000FFFF00000100007F:1F41 01 00000000:00000000 00:00000000 00000000  1001        0 2 1
"""
UDP = """\
   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops
  10: 00000000:C000 00000000:0000 07 00000000:00000000 00:00000000 00000000  1000        0 3 2 0 0
  11: 0100007F:C001 0100007F:1F41 01 00000000:00000000 00:00000000 00000000  1001        0 4 2 0 0
"""
UDP6 = """\
   sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops
  20: 00000000000000000000000000000000:D000 00000000000000000000000000000000:0000 07 00000000:00000000 00:00000000 00000000 65534        0 5 2 0 0
  21: 00000000000000000000000000000000:C001 00000000000000000000000000000000:0000 07 00000000:00000000 00:00000000 00000000  1002        0 6 2 0 0
"""
little_endian = pytest.mark.skipif(sys.byteorder != "little", reason="samples from x86_64")


@little_endian
def test_a_table_is_read_as_the_kernel_prints_it() -> None:
    rows = parse_table(TCP)
    assert [(r.address, r.port, r.state, r.uid) for r in rows] == [
        (V4("127.0.0.1"), 8001, 0x0A, 0),
        (V4("127.0.0.1"), 42718, 0x01, 1000),
        (V4("127.0.0.1"), 42722, 0x06, 0),
        (V4("127.0.0.1"), 0xA700, 0x01, 1000),
        (V4("127.0.0.1"), 0xA700, 0x01, 1001),
    ]
    assert [r.address for r in parse_table(TCP6)] == [V6("::1"), V6("::ffff:127.0.0.1")]
    assert parse_table(TCP.splitlines()[0]) == []
    # Only one port's rows, not those whose remote port is it (8001 = 0x1F41).
    assert [(r.port, r.uid) for r in parse_table(TCP, port=8001)] == [(8001, 0)]


@little_endian
@pytest.mark.parametrize(
    ("address", "port", "datagram", "uids"),
    [
        ("127.0.0.1", 42718, False, {1000}),  # a connected TCP socket
        ("127.0.0.1", 8001, False, set()),  # a listener is nobody's call
        ("127.0.0.1", 42722, False, set()),  # TIME_WAIT: the kernel's leftover, uid 0
        ("::1", 0xB000, False, {65534}),
        ("127.0.0.1", 0xB001, False, {1001}),  # a dual-stack socket's IPv4 form...
        ("::ffff:127.0.0.1", 42718, False, {1000}),  # ...and an IPv4 socket's mapped form
        ("127.0.0.2", 42718, False, set()),  # TCP: the exact address only
        # SO_REUSEADDR: two sockets on one address and port, connected to two addresses of
        # a wildcard listener; which one called is unknown.
        ("127.0.0.1", 0xA700, False, {1000, 1001}),
        ("127.0.0.5", 0xC000, True, {1000}),  # UDP: 0.0.0.0 sends from any IPv4 address
        ("::1", 0xC000, True, set()),  # ...but from no IPv6 one
        ("::1", 0xD000, True, {65534}),  # `::` sends from IPv6...
        ("::ffff:127.0.0.1", 0xD000, True, {65534}),  # ...and IPv4
        ("127.0.0.1", 0xC001, True, {1001, 1002}),  # two owners: who called is unknown
    ],
)
def test_the_owners_a_peer_address_can_be(
    address: str, port: int, datagram: bool, uids: set[int]
) -> None:
    tables = (UDP, UDP6) if datagram else (TCP, TCP6)
    rows = [row for table in tables for row in parse_table(table)]
    assert owners(rows, ipaddress.ip_address(address), port, datagram) == uids


def test_live_sockets_are_found_with_their_owner() -> None:
    uid = os.geteuid()
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        host, port = client.getsockname()
        with client, accepted:
            assert socket_owner(ipaddress.ip_address(host), port, datagram=False) == uid
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as dual:
        dual.bind(("::", 0))
        port = dual.getsockname()[1]
        mapped = ipaddress.ip_address("::ffff:127.0.0.1")
        assert socket_owner(mapped, port, datagram=True) == uid
        assert socket_owner(mapped, port, datagram=False) is None


@contextlib.contextmanager
def connection(host: str) -> Iterator[tuple[int, int]]:
    """A TCP connection to a listener on `host`: the client's port and the listener's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_server((host, 0), family=family) as server:
        server_port = server.getsockname()[1]
        client = socket.create_connection((host, server_port))
        accepted, _ = server.accept()
        with client, accepted:
            yield client.getsockname()[1], server_port


def test_a_connection_is_found_by_its_four_ends() -> None:
    """One exact lookup (sock_diag) when the listener is bound to one address; a listener or
    another far end is no caller."""
    uid = os.geteuid()
    loopback = ipaddress.ip_address("127.0.0.1")
    with connection("127.0.0.1") as (port, server_port):
        assert connected_owner(loopback, port, loopback, server_port) == uid
        assert socket_owner(loopback, port, False, (loopback, server_port)) == uid
        other_end = ipaddress.ip_address("127.0.0.2")
        assert connected_owner(loopback, port, other_end, server_port) is None
        assert connected_owner(loopback, server_port, loopback, 1) is None  # a listener
    with connection("::1") as (port, server_port):
        ipv6 = ipaddress.ip_address("::1")
        assert connected_owner(ipv6, port, ipv6, server_port) == uid


def test_the_exact_lookup_settles_what_it_can_on_its_own() -> None:
    """exact_owner (made on the event loop): a TCP connection to one address settles it, found
    or not; a wildcard listener's settles it only when found; a UDP socket never does (the
    tables, read in a thread, are the only way)."""
    uid = os.geteuid()
    loopback = ipaddress.ip_address("127.0.0.1")
    with connection("127.0.0.1") as (port, server_port):
        bound = (loopback, server_port)
        assert exact_owner(loopback, port, False, bound) == (True, uid)
        assert exact_owner(loopback, port + 1, False, bound) == (True, None)  # none such
        assert exact_owner(loopback, port, False, None, server_port) == (True, uid)
        assert exact_owner(loopback, port + 1, False, None, server_port) == (False, None)
        assert exact_owner(loopback, port, True, bound, server_port) == (False, None)


def test_a_wildcard_listeners_local_caller_is_found_by_one_lookup(tmp_path: Path) -> None:
    """On a wildcard listener a local caller's connection comes from the address it reached:
    found by its four ends without the tables (an empty directory stands for them here);
    one from another source address falls back to the tables."""
    uid = os.geteuid()
    loopback = ipaddress.ip_address("127.0.0.1")
    with socket.create_server(("0.0.0.0", 0)) as server:
        server_port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", server_port))
        accepted, _ = server.accept()
        with client, accepted:
            port = client.getsockname()[1]
            assert socket_owner(loopback, port, False, root=tmp_path) is None  # no tables
            found = socket_owner(loopback, port, False, root=tmp_path, listener_port=server_port)
            assert found == uid
        elsewhere = socket.create_connection(
            ("127.0.0.1", server_port), source_address=("127.0.0.3", 0)
        )
        accepted, _ = server.accept()
        with elsewhere, accepted:
            source = ipaddress.ip_address("127.0.0.3")
            port = elsewhere.getsockname()[1]
            assert (
                socket_owner(source, port, False, root=tmp_path, listener_port=server_port) is None
            )
            assert socket_owner(source, port, False, listener_port=server_port) == uid
