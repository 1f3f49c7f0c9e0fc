"""aioquic's QuicServer with connection admission: limits and Retry decided per new connection,
refusals that keep no state."""

from __future__ import annotations

import contextlib
import os
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
    QuicHeader,
    QuicPacketType,
    encode_quic_retry,
    pull_quic_header,
)
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.retry import QuicRetryTokenHandler

from transport.h3.address_tokens import RETRY_TOKEN_TAG

RETRY_CID_BYTES = 8  # aioquic's own Retry source connection IDs


class Admission(Enum):
    ACCEPT = "accept"
    RETRY = "retry"  # answer with a Retry packet: the client must prove its address
    REFUSE = "refuse"  # close at once with CONNECTION_REFUSED, keeping no state


class AdmittingQuicServer(QuicServer):
    """aioquic's QuicServer, asking `admit(address, validated)` before it creates state for a
    new connection. aioquic's Retry is all or nothing (`retry=True`) and takes every token for
    a Retry token; here Retry tokens start with a tag of their own and the Retry is sent here,
    so an Initial carrying another token (NEW_TOKEN, `address_token(token, address)` says
    whether it validates the address) is let through or answered with a Retry like one
    without. Retry tokens that arrive are always validated (by aioquic: INVALID_TOKEN when
    they fail, RFC 9000 section 8.1.3)."""

    def __init__(
        self,
        *,
        admit: Callable[[NetworkAddress, bool], Admission],
        address_token: Callable[[bytes, NetworkAddress], bool] | None = None,
        queued: Callable[[], Iterable[tuple[bytes, NetworkAddress]]] | None = None,
        steer: Callable[[bytes, NetworkAddress], bool] | None = None,
        **kwargs: Any,
    ):
        """`queued()`: the datagrams already waiting in the endpoint's socket (a bounded burst,
        `transport.h3.udp.queued`), received in the same turn as the one asyncio delivered.
        `steer(datagram, address)`: True when it took a short-header datagram away (one for a
        connection another process owns, transport/h3/datagram_routing.py)."""
        super().__init__(retry=True, **kwargs)
        self._retry = TaggedRetryTokens()
        self._admit = admit
        self._address_token = address_token
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
        retried = header.token.startswith(RETRY_TOKEN_TAG)
        validated = retried or bool(
            header.token
            and self._address_token is not None
            and self._address_token(header.token, addr)
        )
        admission = self._admit(addr, validated)
        assert self._transport is not None and header.version is not None
        if admission is Admission.REFUSE:
            self._transport.sendto(
                encode_refusal(header.version, header.destination_cid, header.source_cid), addr
            )
        elif admission is Admission.RETRY:
            self._transport.sendto(self._encode_retry(header, addr), addr)
        elif retried:
            super().datagram_received(data, addr)
        else:
            with self._without_retry():
                super().datagram_received(data, addr)

    def _encode_retry(self, header: QuicHeader, addr: NetworkAddress) -> bytes:
        """aioquic's Retry, for an Initial with or without a token."""
        assert header.version is not None
        source_cid = os.urandom(RETRY_CID_BYTES)
        return encode_quic_retry(
            version=header.version,
            source_cid=source_cid,
            destination_cid=header.source_cid,
            original_destination_cid=header.destination_cid,
            retry_token=self._retry.create_token(
                address=addr,
                original_destination_connection_id=header.destination_cid,
                retry_source_connection_id=source_cid,
                now=self._loop.time(),
            ),
        )

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


class TaggedRetryTokens(QuicRetryTokenHandler):
    """aioquic's Retry tokens behind the `R` tag, so that they are told apart from NEW_TOKEN
    tokens (RFC 9000 section 8.1.3) before either is opened."""

    def create_token(self, **kwargs: Any) -> bytes:
        return RETRY_TOKEN_TAG + super().create_token(**kwargs)

    def validate_token(self, *, token: bytes, **kwargs: Any) -> bytes:
        if not token.startswith(RETRY_TOKEN_TAG):
            raise ValueError("not a Retry token")
        return super().validate_token(token=token[len(RETRY_TOKEN_TAG) :], **kwargs)


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
