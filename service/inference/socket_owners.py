"""Which user owns a socket of this host, read from the kernel's tables (/proc/net/tcp, tcp6,
udp, udp6): a caller on the server's host is the uid that made the socket the call came from,
as the kernel recorded it when the socket was created. A caller cannot choose what these
tables say about it, unlike anything it sends.

A TCP caller's socket is connected, so its local address is exactly the peer address the
server sees. An HTTP/3 caller's UDP socket may be bound to a wildcard (`0.0.0.0`, or `::`,
which also sends from IPv4 addresses), so a UDP socket answers for every address of its port
its family can send from. Addresses compare with IPv4-mapped IPv6 addresses as their IPv4
form (a dual-stack socket shows an IPv4 peer that way). Sockets of several uids answering for
one address give no owner: who called is then unknown.

Reading a table walks the kernel's whole hash of connections (10 to 15 ms per table on a
large host, however few sockets it holds). A TCP call to a listener bound to one address has
a known far end, so its socket is found by one exact lookup instead (sock_diag, about 40 us):
a connection's four addresses and ports name one socket. A listener on a wildcard address
(`0.0.0.0`, `::`) cannot tell which of its addresses a call reached, and another socket may
share the caller's address and port (SO_REUSEADDR) connected to another of them: those calls
read the tables."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket as sockets_api
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

PROC_NET = Path("/proc/net")
# TCP states (include/net/tcp_states.h) of sockets that are no caller's: a listener, and the
# kernel's leftovers of closed connections (their uid reads 0).
_NOT_A_CALLER = {0x06, 0x07, 0x0A}  # TIME_WAIT, CLOSE, LISTEN
# linux/sock_diag.h, linux/inet_diag.h, linux/netlink.h
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLMSG_ERROR, _NLM_F_REQUEST = 4, 20, 2, 1
_NO_COOKIE = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_UID_AT = _HEADER.size + 64  # inet_diag_msg: 4 bytes, the socket id (48), 3 x u32, uid


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


def connected_owner(address: Address, port: int, server: Address, server_port: int) -> int | None:
    """The uid that owns the TCP socket connected from `address`:`port` to `server`:
    `server_port` on this host, by one exact lookup; None when there is none. OSError when
    the kernel offers no sock_diag here."""
    family = sockets_api.AF_INET if canonical(address).version == 4 else sockets_api.AF_INET6
    ends = (canonical(a).packed.ljust(16, b"\0") for a in (address, server))
    request = (
        struct.pack("=BBBBI", family, sockets_api.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
        + struct.pack(">HH", port, server_port)
        + b"".join(ends)
        + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)
    )
    header = _HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    with sockets_api.socket(
        sockets_api.AF_NETLINK, sockets_api.SOCK_RAW | sockets_api.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG
    ) as netlink:
        netlink.send(header + request)
        answer = netlink.recv(8192)
    if _HEADER.unpack_from(answer)[1] == _NLMSG_ERROR:
        error = -struct.unpack_from("=i", answer, _HEADER.size)[0]
        if error == errno.ENOENT:
            return None
        raise OSError(error, os.strerror(error))
    state = answer[_HEADER.size + 1]
    uid = int.from_bytes(answer[_UID_AT : _UID_AT + 4], sys.byteorder)
    return None if state in _NOT_A_CALLER else uid


def exact_owner(
    address: Address,
    port: int,
    datagram: bool,
    server: tuple[Address, int] | None = None,
    listener_port: int = 0,
) -> tuple[bool, int | None]:
    """(settled, uid): the owner by one exact lookup of a TCP connection (sock_diag, a few
    microseconds: fine on the event loop, where a thread's round trip would cost ten times
    that), when that settles it; else socket_owner reads the tables. `server`: the one
    address and port a TCP call can have reached (a listener bound to one address): its
    lookup settles it either way. `listener_port`: a wildcard listener's port: a local
    caller's connection almost always comes from the very address it reached (the kernel takes
    a local destination as the source), and a connection's two ends name it alone, so one
    exact lookup of that connection settles it when it exists."""
    if not datagram and server is not None:
        with contextlib.suppress(OSError):
            return True, connected_owner(address, port, *server)
    if not datagram and listener_port:
        with contextlib.suppress(OSError):
            uid = connected_owner(address, port, address, listener_port)
            if uid is not None:
                return True, uid
    return False, None


def socket_owner(
    address: Address,
    port: int,
    datagram: bool,
    server: tuple[Address, int] | None = None,
    root: Path = PROC_NET,
    listener_port: int = 0,
) -> int | None:
    """The uid that owns the socket `address`:`port` of this host (UDP if `datagram`, else
    TCP), None when no socket of this host is that, or sockets of several uids could be:
    exact_owner's answer when it settles it, else the tables'. Reading the tables takes the
    kernel 10 to 30 ms (about 100 ms per table with 10,000 TCP sockets): call it off the event
    loop."""
    settled, uid = exact_owner(address, port, datagram, server, listener_port)
    if settled:
        return uid
    names = ("udp", "udp6") if datagram else ("tcp", "tcp6")
    sockets: list[Socket] = []
    for name in names:
        try:
            sockets += parse_table((root / name).read_text(), port)
        except FileNotFoundError:
            continue  # no IPv6 in this kernel
    found = owners(sockets, address, port, datagram)
    return found.pop() if len(found) == 1 else None
