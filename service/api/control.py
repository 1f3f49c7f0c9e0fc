"""paddlequic.v1.Control: what runs where, for operators and tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from protos.paddlequic.v1 import control_pb2 as pb
from protos.paddlequic.v1 import control_pb2_grpc as pb_grpc
from service.inference.errors import ServicerContext, reports_errors
from service.registry.versions import ModelRegistry
from transport.h3.server_state import H3State


class ControlServicer(pb_grpc.ControlServicer):
    def __init__(self, models: ModelRegistry) -> None:
        self.models = models
        self.h3: H3State | None = None  # set once HTTP/3 listens
        # Set with front-end processes: asks each for its counters before they are read.
        self.refresh_counts: Callable[[], Awaitable[None]] | None = None

    async def TransportStats(
        self, request: pb.TransportStatsRequest, context: ServicerContext
    ) -> pb.TransportStatsResponse:
        if self.h3 is None:
            return pb.TransportStatsResponse(h3_enabled=False)
        if self.refresh_counts is not None:
            await self.refresh_counts()
        stats = self.h3.stats
        return pb.TransportStatsResponse(
            h3_enabled=True,
            h3_connections=stats.connections,
            h3_calls=stats.calls,
            h3_rejected_streams=stats.rejected_streams,
            h3_peak_send_buffered=self.h3.peak_send_buffered(),
            h3_blocked_writers=self.h3.blocked_writers(),
            h3_handshakes=stats.handshakes,
            h3_refusals=stats.refusals,
            h3_tickets=dataclasses.asdict(self.h3.tickets.counters)
            if self.h3.tickets is not None
            else {},
        )

    @reports_errors
    async def ListInstances(
        self, request: pb.ListInstancesRequest, context: ServicerContext
    ) -> pb.ListInstancesResponse:
        if self.refresh_counts is not None:  # front-ends' counts too: the requests they hold
            await self.refresh_counts()
        versions = (
            self.models.versions_of(request.model_name)
            if request.model_name
            else self.models.all_versions()
        )
        return pb.ListInstancesResponse(
            instances=[
                pb.Instance(
                    model_name=v.name,
                    model_version=str(v.version),
                    name=i.spec.instance_name,
                    device=i.spec.label,
                    pid=i.pid,
                    state=i.state.value,
                    outstanding=i.outstanding,
                    restarts=i.restarts,
                    unprotected=i.unprotected,
                )
                for v in versions
                for i in v.instances
            ],
            queues=[
                pb.ModelQueue(
                    model_name=v.name,
                    model_version=str(v.version),
                    queued=queue.queued if queue else 0,
                    in_flight=queue.in_flight_requests if queue else 0,
                    breaker=breaker.value,
                    breaker_retry_in_s=retry_in_s,
                )
                for v in versions
                for queue in (v.queue(),)
                for breaker, retry_in_s in (v.shown_breaker(),)
            ],
        )
