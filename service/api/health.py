"""The grpc.health.v1 servicer, kept in step with the readiness of the server and its models."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2

from service.api.service_names import INFERENCE_SERVICE
from service.registry.versions import ModelRegistry


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
