"""The server process: load the models, serve the API, stop cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from cryptography import x509
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.inference import grpc_service_pb2 as inference_pb2
from protos.inference import grpc_service_pb2_grpc as inference_grpc
from protos.paddlequic.v1 import control_pb2, control_pb2_grpc, testing_pb2, testing_pb2_grpc
from service import settings as settings_module
from service.api.control import ControlServicer
from service.api.inference import InferenceServicer
from service.api.reflection import add_reflection
from service.api.request_parsing import ParsingServer
from service.api.restricted import RestrictedServer, RestrictionError, parse_restrictions
from service.api.testing import TestingServicer
from service.api.wire_limits import WireLimitsServer
from service.backend.sandbox.privileges import undumpable
from service.lifecycle.lifecycle import Lifecycle, LifecycleOptions
from service.lifecycle.repository import ModelRepository, RepositoryError
from service.lifecycle.signing import SigningPolicy, TrustError, load_trust
from service.lifecycle.watching import RepositoryWatcher
from service.observability.handlers import ObservedServer, Observer
from service.observability.logs import LineBudget, RequestLog, configure_logging
from service.observability.metrics import Metrics, MetricsUnavailable
from service.observability.tracing import TracingUnavailable, tracer_provider
from service.placement.host import load_topology
from service.registry.versions import ModelRegistry
from service.serving.requests import RequestRunner
from service.settings import ServerSettings
from service.tickets.store import TicketStoreError, open_ticket_store
from transport.h3.aioquic.client_auth import ClientAuth
from transport.h3.datagram_routing import DatagramRouter
from transport.h3.early_data import parse_allowlist
from transport.h3.protocol import H3Settings
from transport.h3.server import H3Limits, H3Server, RetryMode
from transport.h3.server_state import H3State
from transport.tls.certs import describe_trust, ensure_dev_certificates
from transport.tls.session_tickets import TicketStore

log = logging.getLogger("paddlequic.server")

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
CONTROL_SERVICE = control_pb2.DESCRIPTOR.services_by_name["Control"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
TESTING_SERVICE = testing_pb2.DESCRIPTOR.services_by_name["Testing"].full_name


class Health:
    """grpc.health.v1 statuses: "" and the inference service follow server readiness, and
    each model name follows that model's readiness."""

    def __init__(self, models: ModelRegistry) -> None:
        self.servicer = health_async.HealthServicer()
        self.models = models
        self._pending: asyncio.Task[None] | None = None

    def changed(self) -> None:
        if self._pending is None or self._pending.done():
            self._pending = asyncio.get_running_loop().create_task(self._update())

    async def _update(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        overall = serving if self.models.all_ready else not_serving
        await self.servicer.set("", overall)
        await self.servicer.set(INFERENCE_SERVICE, overall)
        for served in self.models.all_versions():
            ready = any(v.ready for v in self.models.versions_of(served.name))
            await self.servicer.set(served.name, serving if ready else not_serving)


async def serve(settings: ServerSettings) -> None:
    loop = asyncio.get_running_loop()
    restrictions = parse_restrictions(settings.restricted_protocol)
    client_auth = check_client_auth(settings)
    frontends = settings_module.frontend_count(settings.frontends)
    # With front-end processes, each opens the store they share (service/frontends).
    tickets = (
        open_ticket_store(settings.ticket_store, settings.ticket_key_file, settings.ticket_ttl)
        if settings.h3 and frontends == 1
        else None
    )
    health: Health | None = None
    tracing = tracer_provider(
        settings.trace_console, settings.otlp_endpoint, settings.trace_sample_ratio
    )
    topology = load_topology(settings.topology)
    models = ModelRegistry(lambda: health.changed() if health else None)
    options = LifecycleOptions(
        model_control_mode=settings.model_control_mode,
        poll_repository=settings.poll_repository,
        load_model=settings.load_model,
        testing_service=settings.testing_service,
    )
    signing: SigningPolicy | None = None
    if settings.trusted_keys or settings.trusted_ca or settings.require_signed:
        trust = load_trust(
            Path(settings.trusted_keys) if settings.trusted_keys else None,
            Path(settings.trusted_ca) if settings.trusted_ca else None,
        )
        signing = SigningPolicy(trust, settings.require_signed)
        log.info(
            "signed models: trusted %s%s",
            ", ".join(trust.names) or "nothing",
            ", unsigned models refused" if settings.require_signed else "",
        )
    health = Health(models)
    metrics = Metrics(models, topology) if settings.metrics else None
    observer = Observer(
        metrics,
        RequestLog(
            settings.slow_request_ms,
            settings.log_sample_ratio,
            settings.log_sample_seed if settings.log_sample_seed >= 0 else None,
            LineBudget(settings.log_failure_burst, settings.log_failure_rate),
        ),
        tracing.get_tracer("paddlequic") if tracing else None,
        settings.trace_sample_ratio,
    )
    runner = RequestRunner(models, observer)
    lifecycle = Lifecycle(
        models,
        runner,
        ModelRepository(settings.model_repository),
        topology,
        options,
        observer,
        signing,
    )
    watcher = RepositoryWatcher(lifecycle, options)
    metrics_server = (
        metrics.serve(settings.metrics_host, settings.metrics_port) if metrics else None
    )
    if metrics_server is not None:
        log.info(
            "metrics on http://%s:%d/metrics",
            _bracket(settings.metrics_host),
            metrics_server.server_port,
        )
    servicers = _Servicers(
        InferenceServicer(models, runner, lifecycle, settings.model_control_mode),
        ControlServicer(models),
        health.servicer,
        TestingServicer() if settings.testing_service else None,
    )

    def register(server: Any, transport: str) -> None:
        """Every servicer, observed, access-checked and refusing unparsable requests, on
        `server` for `transport`; then any other method, answered UNIMPLEMENTED, observed."""
        observed = ObservedServer(server, transport, observer)
        servicers.register(ParsingServer(RestrictedServer(observed, restrictions)))
        observed.observe_unknown_methods()

    public: Listeners
    if frontends > 1:
        # Imported here: a single process never loads the front-end machinery.
        from service.frontends.parent import start_frontends

        public = await start_frontends(settings, frontends, register, metrics)
    else:
        public = await _listen(settings, register, client_auth, tickets)
    servicers.control.h3 = public.h3
    servicers.control.refresh_h3 = public.refresh_h3
    if metrics is not None:
        metrics.state.h3 = public.h3
    health.changed()

    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, watcher.rescan_soon)
    loader = asyncio.create_task(watcher.start())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({loader, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if loader.done() and loader.exception() is not None:
        stop.set()
        log.error("%s", loader.exception())
    elif loader.done():
        log.info("ready: %d model version(s) loaded", sum(v.ready for v in models.all_versions()))
        # What start-up built (modules, protobuf descriptors, loaded models: some 100,000
        # objects) lives as long as the process: the collector's full passes stop walking it.
        # Each pass took some 60 ms of the event loop, about 0.3 ms per new HTTP/3 connection.
        gc.freeze()
    await stopped
    watcher.stop_watching()
    log.info("shutting down: finishing in-flight calls (grace %.1f s)", settings.grace_period)
    await public.stop(settings.grace_period)
    loader.cancel()
    await lifecycle.stop()
    if metrics_server is not None:
        metrics_server.shutdown()
    if tracing is not None:
        tracing.shutdown()
    log.info("stopped")


Register = Callable[[Any, str], None]


class Listeners(Protocol):
    """What accepts the public connections: this process, or front-end processes."""

    @property
    def h3(self) -> H3State | None: ...

    @property
    def refresh_h3(self) -> Callable[[], Awaitable[None]] | None:
        """Brings `h3` up to date (None: it always is)."""

    async def stop(self, grace: float) -> None: ...


@dataclass
class _Listeners:
    """This process's own: one front-end, the default."""

    grpc_server: grpc.aio.Server
    h3_server: H3Server | None

    @property
    def h3(self) -> H3State | None:
        return self.h3_server

    @property
    def refresh_h3(self) -> None:
        return None

    async def stop(self, grace: float) -> None:
        await asyncio.gather(
            self.grpc_server.stop(grace),
            *([self.h3_server.stop(grace)] if self.h3_server else []),
        )


async def _listen(
    settings: ServerSettings,
    register: Register,
    client_auth: ClientAuth | None,
    tickets: TicketStore | None,
) -> _Listeners:
    tls = tls_files(settings) if settings.h3 or settings.h2_tls else None
    server, port = await start_grpc(settings, lambda s: register(s, "h2"), client_auth, tls)
    h3_server = (
        await start_h3(settings, port, lambda s: register(s, "h3"), tls, client_auth, tickets)
        if tls and settings.h3
        else None
    )
    return _Listeners(server, h3_server)


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
    ]
    if reuse_port:
        options.append(("grpc.so_reuseport", 1))
    server = grpc.aio.server(options=options, maximum_concurrent_rpcs=settings.max_concurrent_rpcs)
    register(server)
    address = f"{_bracket(settings.host)}:{settings.grpc_port}"
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
    await server.start()
    log.info(
        "listening: gRPC over HTTP/2%s on %s:%d (model repository %s)",
        " with TLS" if settings.h2_tls else "",
        settings.host,
        port,
        settings.model_repository,
    )
    return server, port


@dataclass(frozen=True)
class _Servicers:
    """The servicer objects, registered on every transport: the same instances serve both."""

    inference: InferenceServicer
    control: ControlServicer
    health: health_async.HealthServicer
    testing: TestingServicer | None

    def register(self, server: Any) -> None:
        # Request size limits come first: nothing else may parse a request over them.
        inference_grpc.add_GRPCInferenceServiceServicer_to_server(
            self.inference, WireLimitsServer(server)
        )
        control_pb2_grpc.add_ControlServicer_to_server(self.control, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [INFERENCE_SERVICE, CONTROL_SERVICE, HEALTH_SERVICE]
        if self.testing is not None:
            testing_pb2_grpc.add_TestingServicer_to_server(self.testing, server)
            names.append(TESTING_SERVICE)
        add_reflection(server, names)


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
) -> H3Server:
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
        ),
        router=router,
    )
    register(h3_server)
    port = await h3_server.start(settings.host, settings.h3_port or tcp_port, cert, key, reuse_port)
    log.info(
        "listening: gRPC over HTTP/3 (QUIC, TLS 1.3, 0-RTT %s) on %s:%d/udp",
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
        return None
    ca_file = Path(settings.tls_client_ca)
    try:
        x509.load_pem_x509_certificates(ca_file.read_bytes())
    except (OSError, ValueError) as exc:
        raise ClientAuthError(f"--tls-client-ca {ca_file}: no PEM certificates ({exc})") from exc
    if settings.require_client_cert and not settings.h2_tls:
        # The HTTP/2 port would stay open to anyone, in plain text.
        raise ClientAuthError("--require-client-cert needs --h2-tls")
    if not settings.h3 and not settings.h2_tls:
        raise ClientAuthError("--tls-client-ca needs TLS: HTTP/3 or --h2-tls")
    log.info(
        "client certificates from %s: %s",
        ca_file,
        "required"
        if settings.require_client_cert
        else "optional (clients without one are served; HTTP/2 does not ask for one)",
    )
    return ClientAuth(ca_file, settings.require_client_cert)


class ClientAuthError(ValueError):
    """Client certificate settings that cannot be served."""


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def main(argv: Sequence[str] | None = None) -> int:
    # Secrets live in this process's environment and memory: no process of the same user
    # without CAP_SYS_PTRACE (a Python model's worker) reads them through /proc.
    undumpable()
    settings = settings_module.parse(argv)
    configure_logging(settings.log_format, settings.log_level)
    logging.getLogger("quic").setLevel(logging.WARNING)  # aioquic logs every connection
    try:
        asyncio.run(serve(settings))
    except (
        RepositoryError,
        TracingUnavailable,
        MetricsUnavailable,
        RestrictionError,
        ClientAuthError,
        TrustError,
        TicketStoreError,
    ) as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
