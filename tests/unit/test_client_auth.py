"""Client certificates: what `issue_client_certificate` writes, and real QUIC handshakes against
a server that asks for one (transport.h3.aioquic.client_auth), with and without requiring it,
full and resumed."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import serve
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.tls import SessionTicket
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from service.tickets.seal import TicketSealer
from service.tickets.sqlite_store import SqliteTicketStore
from transport.h3.aioquic.client_auth import ClientAuth, request_client_certificates
from transport.tls.certs import DevCertificates, ensure_dev_certificates, issue_client_certificate
from transport.tls.session_tickets import MemoryTicketStore, TicketStore

# Bounds the cases expected to fail, so a regression shows up as a failure rather than a hang.
FAILURE_TIMEOUT_S = 5.0


@pytest.fixture
def certs(tmp_path: Path) -> DevCertificates:
    return ensure_dev_certificates(tmp_path / "certs")[0]


def test_client_certificate_is_signed_by_the_dev_ca_for_client_auth(
    certs: DevCertificates,
) -> None:
    cert_path, key_path = issue_client_certificate(certs.directory, "edge-1")
    assert (cert_path.name, key_path.name) == ("client-edge-1.pem", "client-edge-1-key.pem")
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    ca = x509.load_pem_x509_certificate(certs.ca_cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "edge-1"
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert cert.not_valid_after_utc <= ca.not_valid_after_utc
    # The CA stays: servers that trust it keep trusting new clients.
    issue_client_certificate(certs.directory, "edge-2")
    assert x509.load_pem_x509_certificate(certs.ca_cert.read_bytes()) == ca


@pytest.mark.parametrize("name", ["", "../x", "-x", "a b", "x" * 65])
def test_client_names_must_be_plain(certs: DevCertificates, name: str) -> None:
    with pytest.raises(ValueError, match="client name"):
        issue_client_certificate(certs.directory, name)


@asynccontextmanager
async def _server(
    certs: DevCertificates, auth: ClientAuth, tickets: TicketStore | None = None
) -> AsyncIterator[int]:
    configuration = QuicConfiguration(is_client=False, alpn_protocols=["h3"])
    configuration.load_cert_chain(certs.server_cert, certs.server_key)

    def create_protocol(quic: QuicConnection, stream_handler: Any = None) -> Any:
        request_client_certificates(quic, auth)
        return QuicConnectionProtocol(quic)

    server = await serve(
        "127.0.0.1",
        0,
        configuration=configuration,
        create_protocol=create_protocol,
        session_ticket_fetcher=tickets.pop if tickets is not None else None,
        session_ticket_handler=tickets.add if tickets is not None else None,
    )
    try:
        assert server._transport is not None
        yield server._transport.get_extra_info("sockname")[1]
    finally:
        server.close()


async def _connect(
    port: int,
    certs: DevCertificates,
    cert: Path | None,
    key: Path | None,
    ticket: SessionTicket | None = None,
    want_ticket: bool = False,
) -> tuple[bool, SessionTicket | None]:
    """A handshake, then a PING: in TLS 1.3 the client finishes first, so a refusal of its
    certificate arrives afterwards, as the connection closing. Whether it resumed `ticket`;
    with `want_ticket`, the next ticket (the server sends it after the handshake)."""
    configuration = QuicConfiguration(
        is_client=True, alpn_protocols=["h3"], server_name="localhost"
    )
    configuration.load_verify_locations(cafile=str(certs.ca_cert))
    if cert is not None:
        configuration.load_cert_chain(cert, key)
    configuration.session_ticket = ticket
    received: asyncio.Queue[SessionTicket] = asyncio.Queue()
    async with connect(
        "127.0.0.1", port, configuration=configuration, session_ticket_handler=received.put_nowait
    ) as protocol:
        await asyncio.wait_for(protocol.ping(), FAILURE_TIMEOUT_S)
        resumed = protocol._quic.tls.session_resumed
        new_ticket = (
            await asyncio.wait_for(received.get(), FAILURE_TIMEOUT_S) if want_ticket else None
        )
    return resumed, new_ticket


async def test_required_client_certificate(certs: DevCertificates, tmp_path: Path) -> None:
    client_cert, client_key = issue_client_certificate(certs.directory, "edge")
    other = ensure_dev_certificates(tmp_path / "other")[0]
    stranger_cert, stranger_key = issue_client_certificate(other.directory, "stranger")

    async with _server(certs, ClientAuth(certs.ca_cert, required=True)) as port:
        await _connect(port, certs, client_cert, client_key)
        refused = [
            (None, None),  # no certificate
            (stranger_cert, stranger_key),  # from another CA
            (certs.server_cert, certs.server_key),  # the CA's, but for servers only
        ]
        for cert, key in refused:
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(_connect(port, certs, cert, key), FAILURE_TIMEOUT_S)


async def test_optional_client_certificate(certs: DevCertificates, tmp_path: Path) -> None:
    client_cert, client_key = issue_client_certificate(certs.directory, "edge")
    other = ensure_dev_certificates(tmp_path / "other")[0]
    stranger_cert, stranger_key = issue_client_certificate(other.directory, "stranger")

    async with _server(certs, ClientAuth(certs.ca_cert, required=False)) as port:
        await _connect(port, certs, None, None)
        await _connect(port, certs, client_cert, client_key)
        # A certificate that is sent is still checked.
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(
                _connect(port, certs, stranger_cert, stranger_key), FAILURE_TIMEOUT_S
            )


@pytest.mark.parametrize("store", ["memory", "sqlite"])
async def test_a_resumed_connection_keeps_its_certificate_and_is_checked_again(
    certs: DevCertificates, tmp_path: Path, store: str
) -> None:
    """Resumption works with a required certificate, and the certificate the ticket carries
    (in memory, or sealed in a shared store) passes the check again: a server trusting another
    CA refuses it (a full handshake follows, where the client's certificate is refused)."""
    client_cert, client_key = issue_client_certificate(certs.directory, "edge")
    other = ensure_dev_certificates(tmp_path / "other")[0]
    tickets: TicketStore = (
        MemoryTicketStore()
        if store == "memory"
        else SqliteTicketStore(tmp_path / "tickets.db", TicketSealer(os.urandom(32)), 3600.0)
    )
    async with _server(certs, ClientAuth(certs.ca_cert, required=True), tickets) as port:
        resumed, ticket = await _connect(port, certs, client_cert, client_key, want_ticket=True)
        assert not resumed
        for _ in range(2):  # a resumed connection's ticket resumes the identity again
            resumed, ticket = await _connect(port, certs, None, None, ticket, want_ticket=True)
            assert resumed
    assert tickets.counters.redeemed == 2
    async with _server(certs, ClientAuth(other.ca_cert, required=True), tickets) as port:
        with pytest.raises(ConnectionError):
            await _connect(port, certs, client_cert, client_key, ticket)
    assert tickets.counters.redeemed == 3  # found, then refused by the check
