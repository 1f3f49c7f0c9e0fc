"""The parent of a server with front-end processes: it keeps everything but the public
listeners (registry, request path, lifecycle, batchers, workers, metrics, health) and serves the
servicers on a local dispatch endpoint that the front-ends pass every call to."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from service.api.registration import Register
from service.api.restricted import Restriction, restriction_of
from service.dataplane.shared_memory import SharedMemory
from service.frontends.described_call import Serving
from service.frontends.described_infer import DescribedInfer
from service.frontends.descriptors import MODEL_INFER
from service.frontends.dispatch import DispatchServer
from service.frontends.dispatched_call import TRANSPORTS
from service.frontends.host_limits import ParentTally
from service.frontends.listeners import serves_rest_h3, tls_files
from service.frontends.protocol import PART
from service.frontends.region_copies import FrontendRegions
from service.frontends.reports import Reports
from service.frontends.rest_tunnel import TRANSPORT as REST_TRANSPORT
from service.frontends.rest_tunnel import RestTunnel
from service.frontends.runtime import (
    DISPATCH_SOCKET,
    make_runtime_dir,
    shared_tickets,
    write_settings,
)
from service.frontends.stats import FrontendMetrics, FrontendStats
from service.frontends.supervisor import Supervisor
from service.http.app import RestApp
from service.http.listener import reuse_port_socket
from service.observability.observer import Observer
from service.registry.versions import ModelRegistry
from service.serving.requests import RequestRunner
from service.settings import ServerSettings
from service.tickets.store import open_ticket_store
from transport.grpc.handler_table import HandlerTable
from transport.h3 import udp

_PORT_TRIES = 20  # picks of a TCP port whose UDP twin is taken
log = logging.getLogger("paddlequic.frontends")


@dataclass
class Frontends:
    """The Listeners of service/frontends/listeners.py, for front-end processes."""

    h3: FrontendStats | None
    dispatch: DispatchServer
    supervisor: Supervisor
    runtime_dir: Path
    reserved: list[socket.socket]  # the ports front-ends share, held while they come and go

    async def refresh_counts(self) -> None:
        """Every front-end's latest report in: its HTTP/3 counters, and the ModelStatistics
        counts and metrics of the calls it served itself."""
        await self.dispatch.refresh_stats()

    async def stop(self, grace: float) -> None:
        try:
            await self.supervisor.stop(grace)
            await self.dispatch.stop()
        finally:
            for sock in self.reserved:
                sock.close()
            shutil.rmtree(self.runtime_dir, ignore_errors=True)


async def start_frontends(
    settings: ServerSettings,
    count: int,
    register: Register,
    register_parts: Callable[[HandlerTable], None],
    observer: Observer,
    restrictions: Mapping[str, Restriction],
    models: ModelRegistry,
    runner: RequestRunner,
    rest: RestApp | None,
    shared_memory: SharedMemory,
) -> Frontends:
    """`register`: the servicers (`register_parts`: what serves the parts of the streams front-
    ends hold, stream_here.py); ModelInfer calls front-ends describe are run by `runner` on
    the versions of `models` (whose changes they are told), observed by `observer` and
    access-checked by `restrictions` as `register` does for the others. `rest`: what runs the
    REST requests front-ends pass on (None: --http-port 0). Front-ends that serve calls
    themselves hold copies of `shared_memory`'s regions (region_copies.py)."""
    runtime_dir = make_runtime_dir()
    reserved: list[socket.socket] = []
    try:
        grpc_socket, port = _reserve_ports(settings)
        reserved.append(grpc_socket)
        if rest is not None:
            reserved.append(_reserve_rest_port(settings, port))
        shared = _frontend_settings(settings, runtime_dir, port, count)
        write_settings(shared, runtime_dir)
        stats = FrontendStats()
        serving = Serving(
            runner,
            observer,
            restriction_of(restrictions, MODEL_INFER),
            settings.max_message_bytes,
        )
        metrics = observer.metrics
        dispatch = DispatchServer(
            settings.max_message_bytes,
            Reports(stats, models, metrics.reported if metrics is not None else None),
            FrontendMetrics(metrics.registry, stats) if metrics is not None else None,
            DescribedInfer(models, serving),
            FrontendReadiness(models, count).listening,
            settings.instance_queues and settings.frontend_queues,
        )
        dispatch.answered = observer.transport_answered
        for transport in TRANSPORTS:
            register(dispatch.tables[transport], transport)
            dispatch.tables[transport + PART] = HandlerTable()
            register_parts(dispatch.tables[transport + PART])
        if rest is not None:
            dispatch.tables[REST_TRANSPORT] = HandlerTable()
            dispatch.tables[REST_TRANSPORT].add_generic_rpc_handlers([RestTunnel(rest)])
        models.watch(dispatch.push_view)
        await dispatch.start(runtime_dir / DISPATCH_SOCKET)
    except BaseException:
        for sock in reserved:
            sock.close()
        shutil.rmtree(runtime_dir, ignore_errors=True)
        raise
    restarts = dispatch.metrics.restarts.inc if dispatch.metrics is not None else _nothing
    supervisor = Supervisor(count, runtime_dir, restarts, ParentTally(settings, count))
    if dispatch.sharing is not None and shared_memory.mode != "off":
        regions = FrontendRegions(shared_memory.regions, supervisor.kill)
        dispatch.sharing.regions = shared_memory.mirror = regions
    supervisor.start()
    log.info(
        "%d front-end processes on port %d (HTTP/2%s)%s, one scheduler and one set of "
        "workers in this process",
        count,
        port,
        " and HTTP/3" if settings.h3 else "",
        f" and REST port {settings.http_port}" if rest is not None else "",
    )
    return Frontends(stats if settings.h3 else None, dispatch, supervisor, runtime_dir, reserved)


class FrontendReadiness:
    """The server is not ready until every front-end has started its listeners once (a probe
    answered by the first one up says nothing of the others' HTTP/3 sockets); a restarted
    front-end does not take readiness away while the others serve."""

    def __init__(self, models: ModelRegistry, count: int) -> None:
        self._models = models
        self._count = count
        self._listening: set[str] = set()
        models.accepting = False

    def listening(self, index: str) -> None:
        self._listening.add(index)
        if not self._models.accepting and len(self._listening) >= self._count:
            self._models.accepting = True
            self._models.changed()


def _frontend_settings(
    settings: ServerSettings, runtime_dir: Path, port: int, frontends: int
) -> ServerSettings:
    """What every front-end runs with: the port resolved, certificates made once, tickets in a
    store they share (checked here, so a bad one fails the start and not each front-end)."""
    shared = dataclasses.replace(
        settings, grpc_port=port, h3_port=settings.h3_port or port, frontends=str(frontends)
    )
    if settings.h3 or settings.h2_tls or (settings.http_port and settings.http_tls):
        cert, key = tls_files(settings)
        shared = dataclasses.replace(shared, tls_cert=str(cert), tls_key=str(key))
    if settings.h3:
        shared = shared_tickets(shared, runtime_dir)
        open_ticket_store(shared.ticket_store, shared.ticket_key_file, shared.ticket_ttl)
    return shared


def _reserve_ports(settings: ServerSettings) -> tuple[socket.socket, int]:
    """The TCP port reserved, and the UDP port HTTP/3 will use checked free. The check binds
    without SO_REUSEPORT: with it, a socket of another process of this user on that UDP port
    would let the front-ends join its group, and the kernel would spread clients' datagrams
    between two servers (seen in the suite: handshakes answered with another server's
    certificate). A port the OS picked is picked again when its UDP twin is taken; front-ends
    that cannot bind would only be restarted, again and again."""
    for _ in range(_PORT_TRIES):
        reserved, port = _reserve_port(settings.host, settings.grpc_port)
        if not settings.h3:
            return reserved, port
        h3_port = settings.h3_port or port
        try:
            udp.bind(settings.host, h3_port).close()
        except OSError as exc:
            reserved.close()
            if settings.grpc_port or settings.h3_port:
                raise OSError(
                    f"UDP port {h3_port} (HTTP/3): {exc.strerror}: another process holds it; "
                    "stop it or choose another --h3-port"
                ) from exc
            continue
        return reserved, port
    raise OSError(f"no port free for both TCP and UDP after {_PORT_TRIES} tries")


def _reserve_rest_port(settings: ServerSettings, grpc_port: int) -> socket.socket:
    """--http-port held as the gRPC port is, and its UDP twin checked free when HTTP/3 will
    listen there too: a port another process holds stops the start here, naming it, rather
    than each front-end failing to listen."""
    try:
        sock = reuse_port_socket(settings.host, settings.http_port)
    except OSError as exc:
        raise OSError(
            f"TCP port {settings.http_port} (REST): {exc.strerror}: another process holds it; "
            "stop it or choose another --http-port"
        ) from exc
    if serves_rest_h3(settings, grpc_port):
        try:
            udp.bind(settings.host, settings.http_port).close()
        except OSError as exc:
            sock.close()
            raise OSError(
                f"UDP port {settings.http_port} (REST over HTTP/3): {exc.strerror}: another "
                "process holds it; stop it or choose another --http-port"
            ) from exc
    return sock


def _reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """A TCP socket bound (not listening) to the port with SO_REUSEPORT: it picks the number
    for port 0 and holds it while front-ends come and go; connections only reach listeners."""
    sock = reuse_port_socket(host, port)
    return sock, int(sock.getsockname()[1])


def _nothing() -> None:
    return None
