"""The servicers registered on every transport: one set of instances serves them all."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2_grpc

from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as inference_grpc
from protos.paddlequic.v1 import control_pb2_grpc, testing_pb2_grpc
from service.api import stream_parts
from service.api.control import ControlServicer
from service.api.inference import InferenceServicer
from service.api.reflection import add_reflection
from service.api.request_parsing import ParsingServer
from service.api.restricted import RestrictedServer, Restriction
from service.api.service_names import (
    CONTROL_SERVICE,
    HEALTH_SERVICE,
    INFERENCE_SERVICE,
    TESTING_SERVICE,
)
from service.api.stream_inference import StreamItem
from service.api.testing import TestingServicer
from service.api.wire_limits import WireLimitsServer
from service.observability.handlers import ObservedServer
from service.observability.observer import Observer, continued

Register = Callable[[Any, str], None]


@dataclass(frozen=True)
class Servicers:
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


def registration(
    servicers: Servicers, observer: Observer, restrictions: Mapping[str, Restriction]
) -> Register:
    """How `servicers` are registered on a server of any transport."""

    def register(server: Any, transport: str) -> None:
        """Every servicer, observed, access-checked and refusing unparsable requests, on
        `server` for `transport`; then any other method, answered UNIMPLEMENTED, observed."""
        observed = ObservedServer(server, transport, observer)
        servicers.register(ParsingServer(RestrictedServer(observed, restrictions)))
        observed.observe_unknown_methods()

    return register


def part_registration(
    servicers: Servicers, observer: Observer, restrictions: Mapping[str, Restriction]
) -> Callable[[Any], None]:
    """How the parts of ModelStreamInfer streams front-ends hold are served
    (stream_parts.py): checked as on every transport (wire limits, parsing, the restricted
    protocol), and not observed, since the front-end observes the stream they belong to;
    traced within its span."""
    items = servicers.inference.streams.items

    async def part(
        requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[StreamItem]:
        with continued(tuple(context.invocation_metadata() or ())):
            async with contextlib.aclosing(items(requests, context)) as answers:
                async for answer in answers:
                    yield answer

    def register(server: Any) -> None:
        handler = grpc.stream_stream_rpc_method_handler(
            items if observer.tracer is None else part,
            request_deserializer=pb.ModelInferRequest.FromString,
            response_serializer=stream_parts.encode,
        )
        checked = WireLimitsServer(ParsingServer(RestrictedServer(server, restrictions)))
        checked.add_registered_method_handlers(INFERENCE_SERVICE, {"ModelStreamInfer": handler})

    return register
