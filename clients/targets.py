"""Where a URL leads: `grpc://` and `grpcs://` to a grpc.aio channel over HTTP/2 (TLS for the
second), `h3://` to a QuicChannel (HTTP/3), `auto://` to an AutoChannel that starts on HTTP/2
and moves to HTTP/3 once the server advertises it and UDP gets through."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc

from clients.tickets import SessionTicketCache
from clients.transport_policy import TransportPolicy

DEFAULT_PORT = 8001
MAX_MESSAGE_BYTES = 64 << 20
_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str
    port: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_url(url: str) -> Target:
    """`grpc://host:port` (HTTP/2), `grpcs://host:port` (HTTP/2 with TLS), `h3://host:port`
    (HTTP/3) or `auto://host:port` (HTTP/2, moving to HTTP/3 when advertised and reachable); a
    bare `host:port` means grpc."""
    parts = urlsplit(url if "://" in url else f"grpc://{url}")
    if parts.scheme not in ("grpc", "grpcs", "h3", "auto"):
        raise ValueError(
            f"unsupported URL scheme {parts.scheme!r} in {url!r}; use grpc://HOST:PORT "
            "(HTTP/2), grpcs://HOST:PORT (HTTP/2 with TLS), h3://HOST:PORT (HTTP/3) or "
            "auto://HOST:PORT (HTTP/2, then HTTP/3 once the server advertises it)"
        )
    if not parts.hostname:
        raise ValueError(f"URL {url!r} names no host; use grpc://HOST:PORT or h3://HOST:PORT")
    return Target(parts.scheme, parts.hostname, parts.port or DEFAULT_PORT)


def open_channel(
    target: Target,
    ca_file: str | None = None,
    ticket_cache: SessionTicketCache | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
    transport_policy: TransportPolicy | None = None,
) -> Any:
    """A grpc.aio channel (`grpc://`, `grpcs://`), a QuicChannel (`h3://`) or an AutoChannel
    (`auto://`, deciding by `transport_policy`, which channels may share): all take the
    generated stubs and `unary_unary(method)` with raw bytes. Call it inside the event loop
    that uses the channel."""
    if target.scheme in ("h3", "auto"):
        from clients.quic_channel import QuicChannel
        from transport.h3.client import DEFAULT_UNRESPONSIVE_S

        def quic(
            host: str, port: int, unresponsive_s: float = DEFAULT_UNRESPONSIVE_S
        ) -> QuicChannel:
            return QuicChannel(
                Target("h3", host, port).address,
                ca_file=ca_file,
                server_name=target.host,
                ticket_cache=ticket_cache,
                client_cert=client_cert,
                client_key=client_key,
                unresponsive_timeout_s=unresponsive_s,
            )

        if target.scheme == "h3":
            return quic(target.host, target.port)
    if client_cert and target.scheme != "grpcs":
        raise ValueError("a client certificate needs TLS: use grpcs:// or h3://")
    if target.scheme == "auto":
        from clients.auto_channel import H3_UNRESPONSIVE_S, AutoChannel

        h2 = grpc.aio.insecure_channel(target.address, options=_OPTIONS)
        return AutoChannel(
            h2,
            lambda host, port: quic(host, port, H3_UNRESPONSIVE_S),
            target.host,
            transport_policy,
        )
    if target.scheme == "grpcs":
        credentials = grpc.ssl_channel_credentials(
            root_certificates=Path(ca_file).read_bytes() if ca_file else None,
            private_key=Path(client_key or client_cert).read_bytes() if client_cert else None,
            certificate_chain=Path(client_cert).read_bytes() if client_cert else None,
        )
        return grpc.aio.secure_channel(target.address, credentials, options=_OPTIONS)
    return grpc.aio.insecure_channel(target.address, options=_OPTIONS)
