"""The REST port's connections, bounded: at most `--http-max-connections` held at once by this
process (each front-end with --frontends N), counted from the moment one is accepted until its
socket is closed, so a TLS handshake in progress counts as a request being read does. Past the
bound a connection is closed as soon as it is accepted: without one, peers that opened
connections faster than the idle and handshake timeouts closed them held a descriptor each,
and past the process's descriptor limit every other socket, file and worker launch of the
process failed with it.

The count lives in the listening socket: asyncio's accept loop calls its `accept()`, which
refuses past the bound (closes the connection and takes the next, until the kernel's queue is
empty), and every connection it hands out says when it is closed (asyncio's transports close
their socket once, whatever ended them: the peer, a timeout, a failed handshake)."""

from __future__ import annotations

import os
import socket
from typing import Any


class HeldConnections(socket.socket):
    """A listening socket that holds at most `limit` accepted connections at once."""

    limit: int
    held: int  # accepted and not yet closed
    refused: int  # closed as they were accepted, so far

    @classmethod
    def listening(cls, sock: socket.socket, limit: int) -> HeldConnections:
        """`sock` (bound, listening or about to) as one of these: it takes over its descriptor."""
        bounded = cls(sock.family, sock.type, sock.proto, fileno=sock.detach())
        bounded.limit, bounded.held, bounded.refused = limit, 0, 0
        return bounded

    def accept(self) -> tuple[socket.socket, Any]:
        while True:
            fd, address = self._accept()  # type: ignore[attr-defined]
            if self.held < self.limit:
                self.held += 1
                connection = _Held(self.family, self.type, self.proto, fileno=fd)
                connection.ended = self._ended
                if socket.getdefaulttimeout() is None and self.gettimeout():
                    connection.setblocking(True)  # as socket.accept() does
                return connection, address
            self.refused += 1
            os.close(fd)

    def _ended(self) -> None:
        self.held -= 1


class _Held(socket.socket):
    """An accepted connection, counted out of its listener's once, when first closed."""

    ended: Any = None

    def close(self) -> None:
        ended, self.ended = self.ended, None
        if ended is not None:
            ended()
        super().close()
