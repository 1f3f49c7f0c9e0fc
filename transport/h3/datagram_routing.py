"""QUIC datagrams for a connection another process on the same port owns.

With SO_REUSEPORT the kernel picks the process for each datagram from its addresses; when a
client's address changes (NAT rebinding, migration), its datagrams may reach a process that
does not hold its connection, which would drop them: the client would hang until its idle
timeout (aioquic clients never detect stateless resets). So each process issues connection
IDs that start with its index (`transport.h3.aioquic.connection_ids`), and a short-header
datagram whose destination ID starts with another index is passed, with the client's
address, to that process over a unix datagram socket; the owner takes it as if it had
arrived itself and answers from the shared port. Long-header packets (handshakes) never
move: QUIC forbids migrating before the handshake is confirmed."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections.abc import Callable
from pathlib import Path

from aioquic.quic.connection import NetworkAddress

log = logging.getLogger("paddlequic.h3.routing")

ROUTED_CID_LENGTH = 9  # the index byte and 8 random ones (aioquic's default length is 8)
MAX_BURST = 64  # forwarded datagrams taken in one event-loop turn
_ADDRESS_SIZE = struct.Struct(">H")
_MAX_DATAGRAM = 65536


def encode_forwarded(datagram: bytes, address: NetworkAddress) -> bytes:
    raw = json.dumps(list(address)).encode()
    return _ADDRESS_SIZE.pack(len(raw)) + raw + datagram


def decode_forwarded(data: bytes) -> tuple[bytes, NetworkAddress]:
    (size,) = _ADDRESS_SIZE.unpack_from(data)
    end = _ADDRESS_SIZE.size + size
    return data[end:], tuple(json.loads(data[_ADDRESS_SIZE.size : end]))


def owner_of(datagram: bytes) -> int | None:
    """The index a short-header datagram's destination connection ID starts with."""
    if len(datagram) < 1 + ROUTED_CID_LENGTH or datagram[0] & 0x80:
        return None
    return datagram[1]


class DatagramRouter:
    """This process's end: `steer` sends away what another process owns, `start` takes what
    the others send here. The sockets live in `directory`, which only this user can reach."""

    def __init__(self, index: int, directory: Path, port_name: str = "") -> None:
        """`port_name`: which of the shared ports it routes for, when there are several."""
        self.index = index
        self._prefix = f"route-{port_name}-" if port_name else "route-"
        self.forwarded = 0
        self.taken = 0
        self._directory = directory
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        path = self._path(index)
        path.unlink(missing_ok=True)  # left by this index's previous process
        self._sock.bind(str(path))
        self._deliver: Callable[[bytes, NetworkAddress], None] | None = None

    def _path(self, index: int) -> Path:
        return self._directory / f"{self._prefix}{index}.sock"

    def steer(self, datagram: bytes, address: NetworkAddress) -> bool:
        """True when the datagram is another process's: it was passed on (or, if that process
        is gone or behind, dropped like a lost packet)."""
        owner = owner_of(datagram)
        if owner is None or owner == self.index:
            return False
        try:
            self._sock.sendto(encode_forwarded(datagram, address), str(self._path(owner)))
            self.forwarded += 1
        except OSError:
            pass
        return True

    def start(self, deliver: Callable[[bytes, NetworkAddress], None]) -> None:
        self._deliver = deliver
        asyncio.get_running_loop().add_reader(self._sock.fileno(), self._read)

    def _read(self) -> None:
        assert self._deliver is not None
        for _ in range(MAX_BURST):
            try:
                data = self._sock.recv(_MAX_DATAGRAM + 1024)
            except OSError:  # BlockingIOError when empty
                return
            try:
                datagram, address = decode_forwarded(data)
            except (ValueError, TypeError, struct.error):
                continue
            self.taken += 1
            self._deliver(datagram, address)

    def close(self) -> None:
        if self._deliver is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()
        self._path(self.index).unlink(missing_ok=True)
