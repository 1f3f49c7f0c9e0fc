"""Datagrams of a connection another front-end owns: connection IDs carry the owner's index,
and a short-header datagram travels to its owner with the client's address."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from aioquic.quic import connection as connection_module
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import NetworkAddress, QuicConnection

from transport.h3.aioquic.connection_ids import tag_connection_ids
from transport.h3.datagram_routing import (
    ROUTED_CID_LENGTH,
    DatagramRouter,
    decode_forwarded,
    encode_forwarded,
    owner_of,
)
from transport.tls.certs import ensure_dev_certificates


@pytest.fixture
def tagged() -> Iterator[None]:
    try:
        tag_connection_ids(5, ROUTED_CID_LENGTH)
        yield
    finally:
        connection_module.os = os  # type: ignore[attr-defined]


def short_header(owner: int) -> bytes:
    return bytes((0x40, owner)) + os.urandom(ROUTED_CID_LENGTH - 1) + b"payload"


@pytest.mark.usefixtures("tagged")
def test_connection_ids_start_with_the_owners_index(certs_dir: Path) -> None:
    configuration = QuicConfiguration(is_client=False, connection_id_length=ROUTED_CID_LENGTH)
    certs, _ = ensure_dev_certificates(certs_dir)
    configuration.load_cert_chain(certs.server_cert, certs.server_key)
    quic = QuicConnection(configuration=configuration, original_destination_connection_id=b"x")
    assert quic.host_cid[0] == 5 and len(quic.host_cid) == ROUTED_CID_LENGTH
    assert len(os.urandom(8)) == 8  # other random values are untouched


def test_only_short_headers_have_an_owner() -> None:
    assert owner_of(short_header(3)) == 3
    assert owner_of(bytes((0xC0,)) + bytes(40)) is None  # a long header (handshake)
    assert owner_of(b"\x40\x01") is None  # too short to hold a connection ID
    address: NetworkAddress = ("::ffff:127.0.0.1", 4433, 0, 0)
    assert decode_forwarded(encode_forwarded(b"data", address)) == (b"data", address)


async def test_a_datagram_reaches_its_owner_with_the_clients_address(tmp_path: Path) -> None:
    first, second = DatagramRouter(0, tmp_path), DatagramRouter(1, tmp_path)
    arrived: asyncio.Queue[tuple[bytes, NetworkAddress]] = asyncio.Queue()
    second.start(lambda data, address: arrived.put_nowait((data, address)))
    try:
        datagram = short_header(1)
        assert not first.steer(short_header(0), ("10.0.0.1", 1000))  # its own: kept
        assert first.steer(datagram, ("10.0.0.1", 1000))
        assert await asyncio.wait_for(arrived.get(), 5) == (datagram, ("10.0.0.1", 1000))
        assert first.steer(short_header(7), ("10.0.0.1", 1000))  # no such front-end: dropped
        assert (first.forwarded, second.taken) == (1, 1)
    finally:
        first.close()
        second.close()
