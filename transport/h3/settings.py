"""What both ends of an HTTP/3 connection are configured with: its limits and windows."""

from __future__ import annotations

from dataclasses import dataclass

from transport.grpc.framing import DEFAULT_MAX_MESSAGE

DEFAULT_MAX_METADATA = 16 << 10
# UDP payload of the datagrams sent: QUIC guarantees only 1200; 1350 is what Chromium's QUIC
# stack sends by default without path MTU discovery (with IPv6 and UDP headers it fits a tunnel
# MTU of 1400). A unary call with a 1 KiB tensor then fits one datagram instead of two: one
# datagram less to receive, decrypt and acknowledge per call.
DEFAULT_MAX_DATAGRAM = 1350


@dataclass(frozen=True)
class H3Settings:
    max_message: int = DEFAULT_MAX_MESSAGE
    max_metadata: int = DEFAULT_MAX_METADATA  # largest header block, as SETTINGS announce it
    max_concurrent_streams: int = 256
    stream_window: int = 1 << 20
    connection_window: int = 16 << 20
    keepalive_s: float | None = None  # PING this often while the connection is open
    max_datagram_size: int = DEFAULT_MAX_DATAGRAM
