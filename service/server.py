"""The server process: load the models, serve the API, stop cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from service import settings as settings_module
from service.api.control import ControlServicer
from service.api.health import Health
from service.api.inference import InferenceServicer
from service.api.registration import Servicers, part_registration, registration
from service.api.restricted import RestrictionError, parse_restrictions
from service.api.shared_memory import GrpcSharedMemory
from service.api.stream_outbox import StreamBounds
from service.api.testing import TestingServicer
from service.backend.sandbox.privileges import undumpable
from service.dataplane.plane import DataPlane
from service.dataplane.sequence_callers import SequenceCallers
from service.dataplane.shared_memory import SharedMemory
from service.frontends.listeners import (
    ClientAuthError,
    Listeners,
    bracket,
    check_client_auth,
    check_rest,
    listen,
    rest_app,
)
from service.frontends.runtime import observer_of
from service.lifecycle.lifecycle import Lifecycle, LifecycleOptions
from service.lifecycle.loading import WorkerLimits
from service.lifecycle.repository import ModelRepository, RepositoryError
from service.lifecycle.signing import SigningPolicy, TrustError
from service.lifecycle.uploads import UploadLimits
from service.lifecycle.watching import RepositoryWatcher
from service.observability.exposition import on_loop
from service.observability.logs import configure_logging
from service.observability.metrics import Metrics, MetricsUnavailable
from service.observability.scrape_bounds import ScrapeLimits
from service.observability.tracing import TracingUnavailable
from service.placement.host import load_topology
from service.process_memory import release_large_buffers
from service.registry.versions import ModelRegistry
from service.serving.requests import RequestRunner
from service.settings import ServerSettings
from service.tickets.store import TicketStoreError, open_ticket_store

log = logging.getLogger("paddlequic.server")

# A scrape waits at most this long for the front-ends' reports (each is waited for 1 s).
SCRAPE_REFRESH_S = 3.0


async def serve(settings: ServerSettings) -> None:
    release_large_buffers()
    loop = asyncio.get_running_loop()
    restrictions = parse_restrictions(settings.restricted_protocol)
    client_auth = check_client_auth(settings)
    frontends = settings_module.frontend_count(settings.frontends)
    check_rest(settings)
    # With front-end processes, each opens the store they share (service/frontends).
    tickets = (
        open_ticket_store(settings.ticket_store, settings.ticket_key_file, settings.ticket_ttl)
        if settings.h3 and frontends == 1
        else None
    )
    health: Health | None = None
    topology = load_topology(settings.topology)
    models = ModelRegistry(lambda: health.changed() if health else None)
    options = LifecycleOptions(
        model_control_mode=settings.model_control_mode,
        poll_repository=settings.poll_repository,
        load_model=settings.load_model,
        testing_service=settings.testing_service,
        workers=WorkerLimits(
            settings.max_message_bytes,
            settings.model_output_lines,
            settings.model_output_bytes,
            settings.preloaded_launcher,
            settings.model_templates,
            settings.instance_queues,
            settings.instance_queue_mb,
        ),
        uploads=UploadLimits(settings.max_upload_files, settings.max_upload_bytes),
        memory_budget_mb=settings.model_memory_budget,
    )
    signing: SigningPolicy | None = None
    if settings.trusted_keys or settings.trusted_ca or settings.require_signed:
        # Here, not at the top: model-signing takes about a third of a second to import, which
        # every server start (and every front-end's) paid whether it checked signatures or not.
        from service.lifecycle.signatures import load_trust

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
    observer, tracing = observer_of(settings, metrics)
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
        metrics.serve(
            settings.metrics_host,
            settings.metrics_port,
            ScrapeLimits(settings.metrics_max_connections, settings.metrics_timeout),
        )
        if metrics
        else None
    )
    if metrics_server is not None:
        log.info(
            "metrics on http://%s:%d/metrics",
            bracket(settings.metrics_host),
            metrics_server.server_port,
        )
    plane = DataPlane(
        models,
        runner,
        lifecycle,
        settings.server_name,
        SharedMemory(settings.shared_memory),
        settings.model_control_mode,
    )
    servicers = Servicers(
        InferenceServicer(
            plane,
            GrpcSharedMemory(
                plane.shared_memory,
                restrictions.get("shared-memory"),
                listener=(settings.host, settings.grpc_port),
            ),
            settings.max_message_bytes,
            StreamBounds(
                settings.stream_stall_timeout,
                settings.stream_buffer_bytes,
                observer.on_stream_stall,
            ),
            SequenceCallers(settings.sequence_callers),
        ),
        ControlServicer(models),
        health.servicer,
        TestingServicer() if settings.testing_service else None,
    )
    register = registration(servicers, observer, restrictions)

    public: Listeners
    if frontends > 1:
        # Imported here: a single process never loads the front-end machinery.
        from service.frontends.parent import start_frontends

        public = await start_frontends(
            settings,
            frontends,
            register,
            part_registration(servicers, observer, restrictions),
            observer,
            restrictions,
            models,
            runner,
            rest_app(settings, plane, observer, restrictions) if settings.http_port else None,
            plane.shared_memory,
        )
    else:
        public = await listen(
            settings, register, client_auth, tickets, plane, observer, restrictions
        )
    servicers.control.h3 = public.h3
    servicers.control.refresh_counts = public.refresh_counts
    plane.refresh_stats = public.refresh_counts
    if lifecycle.budget is not None:
        lifecycle.budget.refresh = public.refresh_counts
    if metrics is not None:
        metrics.state.h3 = public.h3
        if public.refresh_counts is not None:
            metrics.refresh = on_loop(loop, public.refresh_counts, SCRAPE_REFRESH_S)
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
    elif loader.done() and await _accepting(models, stopped):
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
    plane.shared_memory.regions.close_all()
    if metrics_server is not None:
        metrics_server.shutdown()
    if tracing is not None:
        tracing.shutdown()
    log.info("stopped")


async def _accepting(models: ModelRegistry, stopped: asyncio.Task[bool]) -> bool:
    """Until every listener accepts calls (front-end processes start theirs once the parent
    has loaded its models), so that "ready" in the log means what ServerReady says; False:
    the server was stopped first."""
    if not models.accepting:
        accepting = asyncio.Event()
        models.watch(lambda: accepting.set() if models.accepting else None)
        waiting = asyncio.create_task(accepting.wait())
        await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
    return models.accepting


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
