"""`ParsingServer` (and `WireLimitsServer` inside it): for a handler of every kind, a request
message that does not parse, or a ModelInferRequest over the wire limits, is answered
INVALID_ARGUMENT and never reaches the behavior; a stream's messages before it do."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from protos.inference import grpc_service_pb2 as pb
from service.api.request_parsing import ParsingServer
from service.api.wire_limits import MAX_TENSORS, WireLimitsServer
from tests.unit.handler_kinds import KINDS, REQUESTS, Recorder, call, serving

SERVICE = "paddlequic.v1.Testing"
GARBAGE = b"\xff"  # a field tag with no end: no message parses from it
INFER = pb.ModelInferRequest(model_name="m", inputs=[pb.ModelInferRequest.InferInputTensor()])
OVER_LIMITS = pb.ModelInferRequest(
    model_name="m", inputs=[pb.ModelInferRequest.InferInputTensor()] * (MAX_TENSORS + 1)
)


def registered(recorder: Recorder, wire_limits: bool) -> Any:
    def register(server: grpc.aio.Server) -> None:
        parsing: Any = ParsingServer(server)
        if wire_limits:
            handlers = recorder.handlers(pb.ModelInferRequest.FromString)
            WireLimitsServer(parsing).add_registered_method_handlers(SERVICE, handlers)
        else:
            parsing.add_registered_method_handlers(SERVICE, recorder.handlers())

    return register


@pytest.mark.parametrize("method", KINDS)
@pytest.mark.parametrize("wire_limits", [False, True], ids=["unparsable", "over-limits"])
async def test_a_bad_request_of_every_kind_never_reaches_the_behavior(
    method: str, wire_limits: bool
) -> None:
    recorder = Recorder()
    good = INFER if wire_limits else REQUESTS[0]
    bad = OVER_LIMITS.SerializeToString() if wire_limits else GARBAGE
    request_streaming = KINDS[method][0]
    sent = [good.SerializeToString(), bad] if request_streaming else [bad]
    async with serving(registered(recorder, wire_limits)) as channel:
        code, _ = await call(channel, SERVICE, method, requests=sent)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert recorder.seen == ([(method, good)] if request_streaming else [])
        code, _ = await call(channel, SERVICE, method, requests=[good.SerializeToString()])
    assert code == grpc.StatusCode.OK
    assert recorder.seen[-1] == (method, good)
