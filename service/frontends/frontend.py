"""A front-end process (`python -m service.frontends.frontend`): terminates HTTP/2 and
HTTP/3 (TLS, QUIC, 0-RTT) on the shared port, serves the ModelInfer calls (gRPC and REST) and
the ModelStreamInfer requests on versions it queues for itself straight into the workers'
queues, and passes every other call (and request) to the parent over the dispatch connection
(parent_link.py, rest_here.py, stream_here.py). It never imports Paddle."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from service.api.restricted import parse_restrictions, restriction_of
from service.api.shared_memory import GrpcSharedMemory
from service.api.stream_outbox import StreamBounds
from service.backend.sandbox.privileges import undumpable
from service.dataplane.shared_memory import SharedMemory
from service.frontends.described_call import Serving
from service.frontends.descriptors import (
    MODEL_INFER,
)
from service.frontends.forwarder import Forwarder
from service.frontends.host_limits import FrontendTally
from service.frontends.listeners import (
    check_client_auth,
    rest_app,
    serves_rest_h3,
    start_grpc,
    start_h3,
    start_rest,
)
from service.frontends.parent_link import ParentLink
from service.frontends.queue_sharing import QUEUES_SOCKET
from service.frontends.region_copies import RegionCopies
from service.frontends.rest_forward import RestForwarder
from service.frontends.rest_here import FrontendPlane, RestHere
from service.frontends.runtime import DISPATCH_SOCKET, observer_of, read_settings
from service.frontends.served_here import ServedHere
from service.frontends.shared_versions import SharedVersions
from service.frontends.stream_here import StreamHere
from service.http.asgi import App
from service.inference.shared_memory import SharedMemoryRegions
from service.observability.logs import configure_logging
from service.observability.metrics import Metrics
from service.observability.observer import Observer
from service.process_memory import FreedMemory, release_freed_memory, release_large_buffers
from service.serving.requests import RequestRunner
from service.settings import ServerSettings, frontend_count
from service.tickets.store import open_ticket_store
from transport.h3.calls import TransportAnswer
from transport.h3.datagram_routing import DatagramRouter
from transport.h3.server import H3Server

log = logging.getLogger("paddlequic.frontend")

REPORT_EVERY_S = 1.0
FREED_AFTER_S = 5.0  # calls standing still this long: a burst is over (process_memory.py)


class ParentUnreachable(Exception):
    """The dispatch socket refused the front-end: nothing to serve for."""


async def run(index: int, runtime_dir: Path, settings: ServerSettings, tally_fd: int) -> None:
    release_large_buffers()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # The parent stops every front-end and reloads models once: the terminal's signals to
    # the whole process group are its business.
    for ignored in (signal.SIGINT, signal.SIGHUP):
        signal.signal(ignored, signal.SIG_IGN)
    try:
        reader, writer = await asyncio.open_unix_connection(runtime_dir / DISPATCH_SOCKET)
    except OSError as exc:
        # The parent is gone or not listening: its supervisor (if any) starts a new front-end.
        raise ParentUnreachable(
            f"front-end {index}: cannot reach the parent at {runtime_dir / DISPATCH_SOCKET} "
            f"({exc.strerror or exc}); front-ends are started by `paddlequic serve "
            "--frontends N`, not on their own"
        ) from None
    tally = FrontendTally(tally_fd, settings, frontend_count(settings.frontends), index)
    restrictions = parse_restrictions(settings.restricted_protocol)
    restriction = restriction_of(restrictions, MODEL_INFER)
    link = ParentLink(index, reader, writer, settings.max_message_bytes, restriction)
    link.h2_rpcs = tally.h2_rpcs(settings.max_concurrent_rpcs)
    if settings.metrics:
        link.metrics = Metrics.frontend(link.view.served)
        link.served_here = ServedHere(link.metrics.registry, index)
    # What this process observes itself: the calls its HTTP/3 transport answers before any
    # handler (unknown methods, refused encodings, deadlines during the upload) and those it
    # serves (--frontend-queues), summed into the parent's /metrics.
    observer, tracing = observer_of(settings, link.metrics)
    shared_memory = SharedMemory(settings.shared_memory, SharedMemoryRegions())
    if settings.instance_queues and settings.frontend_queues:
        link.shared = SharedVersions(
            index,
            lambda kind, payload: link.send(kind, 0, payload),
            runtime_dir / QUEUES_SOCKET,
            observer,
            link.counts.stats,
            settings.max_message_bytes,
        )
        link.serving = Serving(
            RequestRunner(link.shared.models, observer),
            observer,
            restriction,
            settings.max_message_bytes,
        )
        if settings.shared_memory != "off":
            # The parent's shared-memory regions, copied here to serve the calls naming them.
            RegionCopies(shared_memory.regions).listen(link.shared.queues, index)
            listener = (settings.host, settings.grpc_port)
            link.shared_memory = GrpcSharedMemory(
                shared_memory, restrictions.get("shared-memory"), listener
            )
        link.streams = StreamHere(
            link.serving,
            StreamBounds(
                settings.stream_stall_timeout,
                settings.stream_buffer_bytes,
                observer.on_stream_stall,
            ),
            link.view.describe,
            link.shared.serving,
            link.open_part,
            link.served_here.stream_request if link.served_here is not None else None,
            link.placed,
        )
    reading = asyncio.create_task(link.run())
    client_auth = check_client_auth(settings)
    tls = (Path(settings.tls_cert), Path(settings.tls_key)) if settings.tls_cert else None
    grpc_server, port = await start_grpc(
        settings,
        lambda s: s.add_generic_rpc_handlers([Forwarder(link, "h2")]),
        client_auth,
        tls,
        reuse_port=True,
    )
    rest: App | None = None
    if settings.http_port:
        rest = forwarder = RestForwarder(link)
        if link.serving is not None and link.shared is not None:
            # REST infer calls on the versions this process queues for itself: served here.
            plane = FrontendPlane(
                link.serving.runner,
                link.view,
                link.shared,
                shared_memory,
                batchstreams=not settings.model_memory_budget,
            )
            observing = link.serving.observer
            here = rest_app(settings, plane, observing, restrictions)
            here.share_host(tally.rest(), tally.rest_bodies())
            rest = RestHere(here, plane, forwarder, link.served_here)
    if tls is not None and settings.h3:
        tickets = open_ticket_store(
            settings.ticket_store, settings.ticket_key_file, settings.ticket_ttl
        )
        # The gRPC port's, then the REST port's number when it is another (each with its own
        # datagram router): both serve gRPC and REST, each stream routed by its request.
        ports = [None, settings.http_port] if rest and serves_rest_h3(settings, port) else [None]
        for scope, udp_port in enumerate(ports):
            link.h3.append(
                await start_h3(
                    settings,
                    port,
                    functools.partial(_register_h3, link, observer),
                    tls,
                    client_auth,
                    tickets,
                    reuse_port=True,
                    router=DatagramRouter(index, runtime_dir, "rest" if udp_port else ""),
                    plain=rest,
                    udp_port=udp_port,
                    host=tally.h3(scope),
                )
            )
    http = (
        await start_rest(settings, rest, tls, client_auth, reuse_port=True)
        if rest is not None
        else None
    )
    link.hello()
    gc.freeze()  # as the single server does once ready: full collections skip start-up's objects
    reporter = asyncio.create_task(_report(link))
    closed = asyncio.create_task(link.closed.wait())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({closed, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if link.closed.is_set() and not stop.is_set():
        log.error("front-end %d: the parent is gone; stopping", index)
    await asyncio.gather(
        grpc_server.stop(settings.grace_period),
        *(h3.stop(settings.grace_period) for h3 in link.h3),
        *([http.stop(settings.grace_period)] if http else []),
    )
    if link.shared is not None:
        await link.shared.stop()
    if tracing is not None:
        tracing.shutdown()
    link.reports.report()
    link.flush()  # the last report goes out before the process ends
    for task in (reporter, closed, stopping, reading):
        task.cancel()


def _register_h3(link: ParentLink, observer: Observer, server: H3Server) -> None:
    """The front-end's handlers on an HTTP/3 server, and the calls it answers itself
    observed here."""
    server.add_generic_rpc_handlers([Forwarder(link, "h3")])

    def answered(answer: TransportAnswer) -> None:
        # Every path is the forwarder's here: the parent's methods say which are methods.
        labelled = dataclasses.replace(answer, registered=answer.method_path in link.methods)
        observer.transport_answered("h3", labelled)

    server.answered = answered


async def _report(link: ParentLink) -> None:
    freed = FreedMemory(FREED_AFTER_S)
    while True:
        now = time.monotonic()
        if freed.due(now, link.reports.report_if_moved(now)):
            release_freed_memory()
        await asyncio.sleep(REPORT_EVERY_S)


def main(argv: Sequence[str] | None = None) -> int:
    undumpable()  # as the server's main process: its environment holds the same secrets
    parser = argparse.ArgumentParser(prog="python -m service.frontends.frontend")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--runtime-dir", type=Path, required=True)
    parser.add_argument("--tally-fd", type=int, required=True)  # host_limits.py
    args = parser.parse_args(argv)
    settings = read_settings(args.runtime_dir)
    configure_logging(settings.log_format, settings.log_level)
    logging.getLogger("quic").setLevel(logging.WARNING)
    log.debug("front-end %d (pid %d) starting", args.index, os.getpid())
    try:
        asyncio.run(run(args.index, args.runtime_dir, settings, args.tally_fd))
    except ParentUnreachable as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
