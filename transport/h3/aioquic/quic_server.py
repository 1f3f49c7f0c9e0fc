"""aioquic's QuicServer with connection admission: limits and Retry decided per new connection,
refusals that keep no state."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from enum import Enum
from typing import Any, cast

from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer  # type: ignore[attr-defined]
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE
from aioquic.quic.connection import TRANSPORT_CLOSE_FRAME_CAPACITY, NetworkAddress
from aioquic.quic.crypto import CryptoPair
from aioquic.quic.packet import (
    QuicErrorCode,
    QuicFrameType,
    QuicPacketType,
    pull_quic_header,
)
from aioquic.quic.packet_builder import QuicPacketBuilder


class Admission(Enum):
    ACCEPT = "accept"
    RETRY = "retry"  # answer with a Retry packet: the client must prove its address
    REFUSE = "refuse"  # close at once with CONNECTION_REFUSED, keeping no state


class AdmittingQuicServer(QuicServer):
    """aioquic's QuicServer, asking `admit(address, has_token)` before it creates state for a
    new connection. aioquic's Retry is all or nothing (`retry=True`); here it is built with a
    token handler and the handler is set aside for the Initials that `admit` lets through
    without Retry. Tokens that arrive are always validated."""

    def __init__(
        self,
        *,
        admit: Callable[[NetworkAddress, bool], Admission],
        queued: Callable[[], Iterable[tuple[bytes, NetworkAddress]]] | None = None,
        steer: Callable[[bytes, NetworkAddress], bool] | None = None,
        **kwargs: Any,
    ):
        """`queued()`: the datagrams already waiting in the endpoint's socket (a bounded burst,
        `transport.h3.udp.queued`), received in the same turn as the one asyncio delivered.
        `steer(datagram, address)`: True when it took a short-header datagram away (one for a
        connection another process owns, transport/h3/datagram_routing.py)."""
        super().__init__(retry=True, **kwargs)
        self._admit = admit
        self._queued = queued
        self._steer = steer

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        self._receive(cast(bytes, data), addr)
        if self._queued is not None:
            for more, more_addr in self._queued():
                self._receive(more, more_addr)

    def receive_forwarded(self, data: bytes, addr: NetworkAddress) -> None:
        """A datagram another process received for a connection of this one."""
        super().datagram_received(data, addr)

    def _receive(self, data: bytes, addr: NetworkAddress) -> None:
        if self._steer is not None and self._steer(data, addr):
            return
        if len(data) < SMALLEST_MAX_DATAGRAM_SIZE or not data[0] & 0x80:
            super().datagram_received(data, addr)  # not a long-header Initial: most traffic
            return
        try:
            header = pull_quic_header(
                Buffer(data=data), host_cid_length=self._configuration.connection_id_length
            )
        except ValueError:
            return
        if (
            header.packet_type != QuicPacketType.INITIAL
            or header.destination_cid in self._protocols
            or header.version not in self._configuration.supported_versions
        ):
            super().datagram_received(data, addr)
            return
        admission = self._admit(addr, bool(header.token))
        if admission is Admission.REFUSE:
            assert self._transport is not None and header.version is not None
            self._transport.sendto(
                encode_refusal(header.version, header.destination_cid, header.source_cid), addr
            )
        elif admission is Admission.RETRY or header.token:
            super().datagram_received(data, addr)
        else:
            with self._without_retry():
                super().datagram_received(data, addr)

    @contextlib.contextmanager
    def _without_retry(self) -> Iterator[None]:
        retry = self._retry
        self._retry = None  # type: ignore[assignment]  # aioquic's own "no Retry" value
        try:
            yield
        finally:
            self._retry = retry

    @property
    def port(self) -> int:
        assert self._transport is not None
        return int(self._transport.get_extra_info("sockname")[1])


def encode_refusal(version: int, source_cid: bytes, destination_cid: bytes) -> bytes:
    """A server Initial packet closing the connection with CONNECTION_REFUSED, as aioquic's
    private `_encode_invalid_token_close` does for INVALID_TOKEN. It is smaller than the
    client's Initial (at least 1200 bytes), so it cannot amplify a spoofed address."""
    crypto = CryptoPair()
    crypto.setup_initial(cid=source_cid, is_client=False, version=version)
    builder = QuicPacketBuilder(
        host_cid=source_cid,
        is_client=False,
        max_datagram_size=SMALLEST_MAX_DATAGRAM_SIZE,
        peer_cid=destination_cid,
        version=version,
    )
    builder.start_packet(QuicPacketType.INITIAL, crypto)
    buf = builder.start_frame(
        QuicFrameType.TRANSPORT_CLOSE, capacity=TRANSPORT_CLOSE_FRAME_CAPACITY
    )
    buf.push_uint_var(QuicErrorCode.CONNECTION_REFUSED)
    buf.push_uint_var(QuicFrameType.PADDING)
    reason = b"too many connections"
    buf.push_uint_var(len(reason))
    buf.push_bytes(reason)
    datagrams, _ = builder.flush()
    return datagrams[0]
