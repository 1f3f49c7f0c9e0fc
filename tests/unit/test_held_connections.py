"""The REST listener's connection bound on a real listening socket and asyncio's own accept
loop: past the bound a connection is closed as it is accepted, and a held one frees its place
however it ends (its peer closing, the server closing it, a TLS handshake that fails)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

from service.http.held_connections import HeldConnections
from service.http.listener import tls_context
from tests.servers import stream_closed_by_peer
from transport.tls.certs import ensure_dev_certificates

LIMIT = 3
WAIT_S = 10.0  # a bound on each wait below, not a timing


async def _held(listener: HeldConnections, count: int) -> None:
    async with asyncio.timeout(WAIT_S):
        while listener.held != count:
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def serving(context: ssl.SSLContext | None) -> AsyncIterator[HeldConnections]:
    """A listener whose connections wait for their peer's line, answer it and close."""
    plain = socket.create_server(("127.0.0.1", 0))
    listener = HeldConnections.listening(plain, LIMIT)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(await reader.readline())
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, sock=listener, ssl=context)
    try:
        yield listener
    finally:
        server.close()
        await server.wait_closed()


async def test_past_its_bound_a_connection_is_closed_as_it_is_accepted() -> None:
    async with serving(None) as listener:
        port = listener.getsockname()[1]
        peers = [await asyncio.open_connection("127.0.0.1", port) for _ in range(LIMIT * 3)]
        closed = [await stream_closed_by_peer(reader, 0.5) for reader, _ in peers]
        assert closed.count(False) == LIMIT
        assert (listener.held, listener.refused) == (LIMIT, LIMIT * 2)
        # A held one answered and closed by the server frees its place, for a new peer.
        reader, writer = next(p for p, gone in zip(peers, closed, strict=True) if not gone)
        writer.write(b"hello\n")
        assert await reader.readline() == b"hello\n"
        await _held(listener, LIMIT - 1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"again\n")
        assert await reader.readline() == b"again\n"
        # Peers that go away free theirs.
        for _, writer in peers:
            writer.close()
        await _held(listener, 0)


async def test_a_failed_tls_handshake_frees_its_place(tmp_path: Path) -> None:
    certificates, _ = ensure_dev_certificates(tmp_path)
    context = tls_context((certificates.server_cert, certificates.server_key), None)
    async with serving(context) as listener:
        port = listener.getsockname()[1]
        # A handshake in progress holds a place: not a ClientHello, then nothing more.
        peers = [await asyncio.open_connection("127.0.0.1", port) for _ in range(LIMIT)]
        await _held(listener, LIMIT)
        _, refused = await asyncio.open_connection("127.0.0.1", port)
        await _held(listener, LIMIT)  # it was closed, not held
        for _, writer in peers:
            writer.write(b"not a TLS record\r\n\r\n")
        await _held(listener, 0)  # each handshake failed, each place freed
        refused.close()
        client = ssl.create_default_context(cafile=str(certificates.ca_cert))
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client, server_hostname="localhost"
        )
        writer.write(b"over TLS\n")
        assert await reader.readline() == b"over TLS\n"
        writer.close()
        for _, writer in peers:
            writer.close()
