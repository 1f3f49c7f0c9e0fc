"""ModelStreamInfer against a client that stops reading its responses: the server stops
reading its requests (transport backpressure) instead of queueing answers without bound.

The stall is recognised by counting, not by waiting: the server answered many looks in a row
(each one a round trip through the event loop that would read the stream) while it ran nothing
of the model and neither the client's writes nor its answers moved."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1 import control_pb2, control_pb2_grpc
from tests.conformance.conftest import ChannelFactory
from tests.reference import assert_outputs, run_reference
from tests.servers import ServerProcess

ROWS = 64  # 64 KiB per request, 2.5 KiB per response
# Each transport stalls well before what it is sent: the stream window, then what the
# transports buffer (observed: about 870 answered requests on HTTP/3, about 1,700 on HTTP/2).
# HTTP/3 is sent fewer: aioquic moves its 64 KiB requests slowly on both ends.
SENT = {"h2": 3000, "h3": 1500}
STALLED_BELOW = {"h2": 2500, "h3": 1300}
QUIET_LOOKS = 20  # looks in a row at a server that runs nothing and reads nothing
STALL_LIMIT_S = 120.0  # generous bounds: only a broken server reaches them
READ_LIMIT_S = 240.0
DISTINCT = 7  # different inputs, taken in turn
RSS_GROWTH_LIMIT = 64 << 20  # reading all that is sent would hold 96 or 190 MiB of requests


async def _look(server: ServerProcess) -> tuple[int, int]:
    """Requests of the stream's model the server has run (it reads a request only to run it),
    and those it holds queued or in a worker."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="mlp"), timeout=30)
        control = control_pb2_grpc.ControlStub(channel)
        listed = await control.ListInstances(
            control_pb2.ListInstancesRequest(model_name="mlp"), timeout=30
        )
    answered = sum(s.inference_stats.success.count for s in stats.model_stats)
    return answered, sum(q.queued + q.in_flight for q in listed.queues)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


@pytest.mark.timeout(STALL_LIMIT_S + READ_LIMIT_S + 60)  # the two phases' own bounds fire first
async def test_stream_client_that_does_not_read_stops_being_read(
    make_channel: ChannelFactory, conformance_server: ServerProcess, transport: str
) -> None:
    # Request i sends inputs[i % DISTINCT]: answers that changed places fail their check.
    rng = np.random.default_rng(0)
    inputs = [{"input": rng.random((ROWS, 256), np.float32)} for _ in range(DISTINCT)]
    expected = [run_reference("mlp", x) for x in inputs]
    sent = SENT[transport]
    requests = [build_request("mlp", inputs[i % DISTINCT], request_id=str(i)) for i in range(sent)]
    pid = conformance_server.process.pid

    before, _ = await _look(conformance_server)
    rss_before = _rss(pid)
    async with make_channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer()  # bounded by the two phases' limits below
        written = 0

        async def write_all() -> None:
            nonlocal written
            for request in requests:
                await call.write(request)
                written += 1
            await call.done_writing()

        writer = asyncio.create_task(write_all())
        # Until the server runs nothing of the model and neither side moves, QUIET_LOOKS in a row.
        last, quiet = (-1, -1), 0
        async with asyncio.timeout(STALL_LIMIT_S):
            while quiet < QUIET_LOOKS:
                assert not writer.done(), "the server read every request"
                answered, holding = await _look(conformance_server)
                now = (written, answered - before)
                quiet = quiet + 1 if now == last and holding == 0 else 0
                last = now
        assert 0 < last[1] < STALLED_BELOW[transport]
        assert written < sent and not writer.done()
        assert _rss(pid) - rss_before < RSS_GROWTH_LIMIT

        ids = set()
        async with asyncio.timeout(READ_LIMIT_S):
            async for response in call:
                assert response.error_message == ""
                ids.add(response.infer_response.id)
                assert_outputs(
                    expected[int(response.infer_response.id) % DISTINCT], response.infer_response
                )
            await writer
        assert ids == {str(i) for i in range(sent)}
        assert await call.code() == grpc.StatusCode.OK
