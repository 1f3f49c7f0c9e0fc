"""The public listeners (gRPC over HTTP/2 and HTTP/3, TLS; REST over HTTP/1.1 and HTTP/2):
this process's, or each front-end's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from cryptography import x509

from service.api.registration import Register
from service.api.restricted import Restriction, rest_guard
from service.dataplane.plane import DataPlane
from service.dataplane.sequence_callers import SequenceCallers
from service.frontends.rest_here import FrontendPlane
from service.frontends.stats import ProcessH3
from service.http.app import RestApp
from service.http.asgi import App
from service.http.batchstream import BatchStreams
from service.http.bounds import RequestLimits
from service.http.generate_route import GenerateRoute
from service.http.infer_route import InferRoute
from service.http.listener import HttpListener, HttpOptions, sending_within, start_http
from service.http.openai import Completions
from service.http.router import Guard, InferRouter, Router
from service.http.routes import Routes
from service.observability.observer import Observer
from service.settings import ServerSettings
from service.tickets.store import open_address_tokens
from transport.grpc import alt_svc
from transport.grpc.aborts import ReleasingServer
from transport.grpc.response_headers import PerConnection, ResponseHeadersServer
from transport.h3.admission import H3Limits, RetryMode
from transport.h3.aioquic.client_auth import ClientAuth
from transport.h3.datagram_routing import DatagramRouter
from transport.h3.early_data import parse_allowlist
from transport.h3.server import H3Server
from transport.h3.server_state import H3State
from transport.h3.settings import H3Settings
from transport.host_tally import ScopedTally
from transport.tls.certs import describe_trust, ensure_dev_certificates
from transport.tls.session_tickets import TicketStore

log = logging.getLogger("paddlequic.server")

# How often a connection's responses advertise HTTP/3 again (at most; half the advertised
# lifetime when that is shorter), so a client's memory of it never lapses while it calls.
ADVERTISE_REFRESH_S = 60.0


class Listeners(Protocol):
    """What accepts the public connections: this process, or front-end processes."""

    @property
    def h3(self) -> H3State | None: ...

    @property
    def refresh_counts(self) -> Callable[[], Awaitable[None]] | None:
        """Brings `h3` up to date, and what front-end processes count of the calls they serve
        (ModelStatistics, metrics) (None: it always is)."""

    async def stop(self, grace: float) -> None: ...


@dataclass
class _Listeners:
    """This process's own: one front-end, the default."""

    grpc_server: grpc.aio.Server
    h3_server: H3Server | None
    http: HttpListener | None
    http_h3: H3Server | None  # HTTP/3 on the REST port's number

    @property
    def h3(self) -> H3State | None:
        servers = [s for s in (self.h3_server, self.http_h3) if s is not None]
        return ProcessH3(servers) if servers else None

    @property
    def refresh_counts(self) -> None:
        return None

    async def stop(self, grace: float) -> None:
        await asyncio.gather(
            self.grpc_server.stop(grace),
            *([self.h3_server.stop(grace)] if self.h3_server else []),
            *([self.http.stop(grace)] if self.http else []),
            *([self.http_h3.stop(grace)] if self.http_h3 else []),
        )


async def listen(
    settings: ServerSettings,
    register: Register,
    client_auth: ClientAuth | None,
    tickets: TicketStore | None,
    plane: DataPlane,
    observer: Observer,
    restrictions: Mapping[str, Restriction],
) -> _Listeners:
    tls = tls_files(settings) if settings.h3 or settings.h2_tls or settings.http_tls else None
    rest = rest_app(settings, plane, observer, restrictions) if settings.http_port else None
    http = await start_rest(settings, rest, tls, client_auth) if rest is not None else None
    server, port = await start_grpc(settings, lambda s: register(s, "h2"), client_auth, tls)
    h3_server = (
        await start_h3(
            settings, port, lambda s: register(s, "h3"), tls, client_auth, tickets, plain=rest
        )
        if tls and settings.h3
        else None
    )
    http_h3 = (
        await start_h3(
            settings,
            port,
            lambda s: register(s, "h3"),
            tls,
            client_auth,
            tickets,
            plain=rest,
            udp_port=settings.http_port,
        )
        if tls and rest is not None and serves_rest_h3(settings, port)
        else None
    )
    return _Listeners(server, h3_server, http, http_h3)


def serves_rest_h3(settings: ServerSettings, grpc_port: int) -> bool:
    """Whether HTTP/3 also listens on the REST port's number (UDP): with HTTP/3 and REST on,
    unless the HTTP/3 port is that number already."""
    return (
        settings.h3
        and bool(settings.http_port)
        and settings.http_port != (settings.h3_port or grpc_port)
    )


def rest_app(
    settings: ServerSettings,
    plane: DataPlane | FrontendPlane,
    observer: Observer,
    restrictions: Mapping[str, Restriction],
) -> RestApp:
    """The KServe v2 REST API over the parent's data plane, the same as gRPC's; over a
    front-end's plane (the versions it serves itself), the infer, generate, completions and
    batchstream routes alone."""
    limits, guard = rest_checks(settings, restrictions)
    route = InferRoute(
        plane, SequenceCallers(settings.sequence_callers), settings.http_max_input_size
    )
    if isinstance(plane, DataPlane):
        return RestApp(Router(Routes(plane, route), limits, observer, guard))
    completions = Completions(plane, plane.generation_model)
    batchstream = BatchStreams(
        plane, plane.streamed_generation_model, plane.generation_names, limits.body_timeout_s
    )
    generate = GenerateRoute(plane)
    return RestApp(InferRouter(route, generate, completions, limits, observer, guard, batchstream))


def rest_checks(
    settings: ServerSettings, restrictions: Mapping[str, Restriction]
) -> tuple[RequestLimits, Guard | None]:
    """What every REST request is held to: its bounds, and --restricted-protocol's headers."""
    limits = RequestLimits(
        settings.max_metadata_bytes,
        settings.http_max_input_size,
        settings.http_body_timeout,
        settings.max_concurrent_rpcs,
        settings.stream_stall_timeout,
        settings.http_receive_budget,
        settings.http_receive_budget_per_address,
    )
    return limits, rest_guard(restrictions) if restrictions else None


async def start_rest(
    settings: ServerSettings,
    app: App,
    tls: tuple[Path, Path] | None,
    client_auth: ClientAuth | None,
    reuse_port: bool = False,
) -> HttpListener:
    """`app` on --http-port over TCP, with --http-tls asking for client certificates as
    `client_auth` says (as gRPC's TLS port); `reuse_port`: share the port with other processes
    (SO_REUSEPORT: front-ends)."""
    advertised = settings.h3 and settings.http_tls and settings.alt_svc_max_age > 0
    options = HttpOptions(
        settings.host,
        settings.http_port,
        settings.max_metadata_bytes,
        settings.http_keepalive_timeout,
        settings.http_max_connections,
        tls if settings.http_tls else None,
        reuse_port,
        # HTTP/3 answers on the same number over UDP (it speaks only TLS: an https origin).
        (
            (
                alt_svc.HEADER.encode(),
                alt_svc.h3_header(settings.http_port, settings.alt_svc_max_age).encode(),
            ),
        )
        if advertised
        else (),
        client_auth if settings.http_tls else None,
        settings.http_send_timeout,
    )
    return await start_http(app, options, settings.grace_period)


async def start_grpc(
    settings: ServerSettings,
    register: Callable[[Any], None],
    client_auth: ClientAuth | None,
    tls: tuple[Path, Path] | None,
    reuse_port: bool = False,
) -> tuple[grpc.aio.Server, int]:
    """The HTTP/2 server, started; returns it and its port. `reuse_port`: share the port with
    other processes (SO_REUSEPORT)."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_metadata_size", settings.max_metadata_bytes),
        # grpc core has no per-address limit; the total and idle connections are bounded.
        ("grpc.max_allowed_incoming_connections", settings.h2_max_connections),
        ("grpc.max_connection_idle_ms", int(settings.idle_timeout * 1000)),
        # Idle time starts once the handshake is done; grpc core's own bound on a handshake
        # (a TLS peer that never sends its ClientHello) is 120 s.
        ("grpc.server_handshake_timeout_ms", int(settings.h2_handshake_timeout * 1000)),
    ]
    if reuse_port:
        options.append(("grpc.so_reuseport", 1))
    server = grpc.aio.server(options=options, maximum_concurrent_rpcs=settings.max_concurrent_rpcs)
    address = f"{bracket(settings.host)}:{settings.grpc_port}"
    if settings.h2_tls:
        assert tls is not None
        # grpcio can require a client certificate or not ask for one: without
        # --require-client-cert it does not ask (HTTP/3 asks and checks one that is sent).
        credentials = grpc.ssl_server_credentials(
            [(tls[1].read_bytes(), tls[0].read_bytes())],
            root_certificates=client_auth.ca_file.read_bytes() if client_auth else None,
            require_client_auth=client_auth is not None and client_auth.required,
        )
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    # Registered once the port is known: alt-svc names the HTTP/3 port, by default the same.
    headers = alt_svc_headers(settings, port)
    refresh_s = min(ADVERTISE_REFRESH_S, settings.alt_svc_max_age / 2)
    released = ReleasingServer(server)
    register(
        ResponseHeadersServer(released, headers, PerConnection(refresh_s)) if headers else released
    )
    await server.start()
    log.info(
        "listening: gRPC over HTTP/2%s on %s:%d (model repository %s)",
        " with TLS" if settings.h2_tls else "",
        settings.host,
        port,
        settings.model_repository,
    )
    return server, port


def _kept() -> None:
    """The connection kept: over HTTP/3 the stalled stream alone is reset."""


def alt_svc_headers(settings: ServerSettings, tcp_port: int) -> tuple[tuple[str, str], ...]:
    """What every HTTP/2 response adds: where HTTP/3 answers, when it is served."""
    if not settings.h3 or settings.alt_svc_max_age <= 0:
        return ()
    return (
        (alt_svc.HEADER, alt_svc.h3_header(settings.h3_port or tcp_port, settings.alt_svc_max_age)),
    )


def tls_files(settings: ServerSettings) -> tuple[Path, Path]:
    """Certificate chain and key: --tls-cert/--tls-key, or the development certificates."""
    if settings.tls_cert:
        return Path(settings.tls_cert), Path(settings.tls_key or settings.tls_cert)
    certs, created = ensure_dev_certificates(settings.certs_dir)
    log.info(
        "%s development certificates in %s\n%s",
        "created" if created else "using",
        certs.directory,
        describe_trust(certs),
    )
    return certs.server_cert, certs.server_key


async def start_h3(
    settings: ServerSettings,
    tcp_port: int,
    register: Callable[[Any], None],
    tls: tuple[Path, Path],
    client_auth: ClientAuth | None,
    tickets: TicketStore | None,
    reuse_port: bool = False,
    router: DatagramRouter | None = None,
    plain: App | None = None,
    udp_port: int | None = None,
    host: ScopedTally | None = None,
) -> H3Server:
    """gRPC over HTTP/3 on --h3-port (or `tcp_port`'s number), or on `udp_port`; `plain`:
    the REST app that serves the requests that are not gRPC, on the same connections;
    `host`: where the front-ends count what they hold together (host_limits.py)."""
    cert, key = tls
    h3_server = H3Server(
        H3Settings(
            max_message=settings.max_message_bytes, max_metadata=settings.max_metadata_bytes
        ),
        tickets=tickets,
        zero_rtt=settings.zero_rtt,
        early_data_methods=parse_allowlist(settings.early_data_methods),
        idle_timeout_s=settings.idle_timeout,
        client_auth=client_auth,
        max_concurrent_rpcs=settings.max_concurrent_rpcs,
        limits=H3Limits(
            max_connections=settings.h3_max_connections,
            max_connections_per_address=settings.h3_max_connections_per_address,
            handshake_timeout_s=settings.h3_handshake_timeout,
            retry=RetryMode(settings.h3_retry),
            receive_budget_per_address=settings.h3_receive_budget_per_address,
            receive_budget_total=settings.h3_receive_budget,
        ),
        router=router,
        address_tokens=open_address_tokens(settings.ticket_key_file, settings.h3_token_lifetime),
        # Each piece of an answer within --http-send-timeout, as over TCP; over HTTP/3 an app
        # that ends in the middle of its answer has its stream reset (transport/h3/asgi.py).
        plain=None if plain is None else sending_within(plain, settings.http_send_timeout, _kept),
        host=host,
    )
    register(h3_server)
    port = await h3_server.start(
        settings.host, udp_port or settings.h3_port or tcp_port, cert, key, reuse_port
    )
    log.info(
        "listening: gRPC%s over HTTP/3 (QUIC, TLS 1.3, 0-RTT %s) on %s:%d/udp",
        " and REST" if plain is not None else "",
        "on" if settings.zero_rtt else "off",
        settings.host,
        port,
    )
    return h3_server


def check_client_auth(settings: ServerSettings) -> ClientAuth | None:
    """Mutual TLS from --tls-client-ca / --require-client-cert, checked before serving."""
    if not settings.tls_client_ca:
        if settings.require_client_cert:
            raise ClientAuthError("--require-client-cert needs --tls-client-ca")
        if settings.sequence_callers == "certified":
            # No caller could have a certificate: no one could use a sequence model.
            raise ClientAuthError("--sequence-callers certified needs --tls-client-ca")
        return None
    ca_file = Path(settings.tls_client_ca)
    try:
        x509.load_pem_x509_certificates(ca_file.read_bytes())
    except (OSError, ValueError) as exc:
        raise ClientAuthError(f"--tls-client-ca {ca_file}: no PEM certificates ({exc})") from exc
    if settings.require_client_cert and not settings.h2_tls:
        # The HTTP/2 port would stay open to anyone, in plain text.
        raise ClientAuthError("--require-client-cert needs --h2-tls")
    if not settings.h3 and not settings.h2_tls and not settings.http_tls:
        raise ClientAuthError("--tls-client-ca needs TLS: HTTP/3, --h2-tls or --http-tls")
    log.info(
        "client certificates from %s: %s",
        ca_file,
        "required"
        if settings.require_client_cert
        else "optional (clients without one are served; gRPC's HTTP/2 does not ask for one)",
    )
    return ClientAuth(ca_file, settings.require_client_cert)


def check_rest(settings: ServerSettings) -> None:
    """A server told to require client certificates serves REST only where it can ask for
    one, over TLS: not on a plain TCP port open to anyone (checked at start)."""
    if settings.http_port and settings.require_client_cert and not settings.http_tls:
        # The REST port would stay open to anyone, in plain text (as --h2-tls for gRPC).
        raise ClientAuthError("--require-client-cert needs --http-tls (or --http-port 0)")


class ClientAuthError(ValueError):
    """Client certificate settings that cannot be served."""


def bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
