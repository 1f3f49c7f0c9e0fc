"""Which user owns a socket of this host, read from the kernel's tables (/proc/net/tcp, tcp6,
udp, udp6): a caller on the server's host is the uid that made the socket the call came from,
as the kernel recorded it when the socket was created. A caller cannot choose what these
tables say about it, unlike anything it sends.

A TCP caller's socket is connected, so its local address is exactly the peer address the
server sees. An HTTP/3 caller's UDP socket may be bound to a wildcard (`0.0.0.0`, or `::`,
which also sends from IPv4 addresses), so a UDP socket answers for every address of its port
its family can send from. Addresses compare with IPv4-mapped IPv6 addresses as their IPv4
form (a dual-stack socket shows an IPv4 peer that way). Sockets of several uids answering for
one address give no owner: who called is then unknown."""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

PROC_NET = Path("/proc/net")
# TCP states (include/net/tcp_states.h) of sockets that are no caller's: a listener, and the
# kernel's leftovers of closed connections (their uid reads 0).
_NOT_A_CALLER = {0x06, 0x07, 0x0A}  # TIME_WAIT, CLOSE, LISTEN


@dataclass(frozen=True)
class Socket:
    """One row of a /proc/net table."""

    address: Address
    port: int
    state: int
    uid: int


def canonical(address: Address) -> Address:
    """An IPv4-mapped IPv6 address as its IPv4 form; any other as it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_table(text: str, port: int | None = None) -> list[Socket]:
    """The sockets of one /proc/net/{tcp,tcp6,udp,udp6} table (its header line skipped); only
    those bound to `port`, if given (a table may hold tens of thousands of rows)."""
    needle = None if port is None else f":{port:04X} "
    sockets = []
    for line in text.splitlines()[1:]:
        if needle is not None and needle not in line:
            continue
        fields = line.split()
        if len(fields) < 8:
            continue
        host, _, local_port = fields[1].partition(":")
        found = Socket(_address(host), int(local_port, 16), int(fields[3], 16), int(fields[7]))
        if port is None or found.port == port:
            sockets.append(found)
    return sockets


def _address(hex_words: str) -> Address:
    """The kernel prints an address as 32-bit words, each in the host's byte order."""
    raw = b"".join(
        int(hex_words[i : i + 8], 16).to_bytes(4, sys.byteorder)
        for i in range(0, len(hex_words), 8)
    )
    return ipaddress.ip_address(raw)


def owners(sockets: Iterable[Socket], address: Address, port: int, datagram: bool) -> set[int]:
    """The uids of the sockets that `address`:`port` can be: over TCP the connected socket
    bound to exactly that; over UDP also a wildcard bound to the port that can send from it."""
    wanted = canonical(address)
    found = set()
    for socket in sockets:
        if socket.port != port:
            continue
        if canonical(socket.address) == wanted:
            if datagram or socket.state not in _NOT_A_CALLER:
                found.add(socket.uid)
        elif (
            datagram
            and socket.address.is_unspecified
            # `::` sends from IPv6 and IPv4 (unless IPV6_V6ONLY); `0.0.0.0` from IPv4 only.
            and (socket.address.version == 6 or wanted.version == 4)
        ):
            found.add(socket.uid)
    return found


def socket_owner(address: Address, port: int, datagram: bool, root: Path = PROC_NET) -> int | None:
    """The uid that owns the socket `address`:`port` of this host (UDP if `datagram`, else
    TCP), None when no socket of this host is that, or sockets of several uids could be.
    Reading the tables takes the kernel time in proportion to the host's sockets (about 100 ms
    for 10,000 TCP sockets here): call it off the event loop."""
    names = ("udp", "udp6") if datagram else ("tcp", "tcp6")
    sockets: list[Socket] = []
    for name in names:
        try:
            sockets += parse_table((root / name).read_text(), port)
        except FileNotFoundError:
            continue  # no IPv6 in this kernel
    found = owners(sockets, address, port, datagram)
    return found.pop() if len(found) == 1 else None
