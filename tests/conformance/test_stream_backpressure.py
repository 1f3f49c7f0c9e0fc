"""ModelStreamInfer against a client that stops reading its responses: the server stops
reading its requests (transport backpressure) instead of queueing answers without bound."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.conformance.conftest import ChannelFactory
from tests.reference import assert_outputs, run_reference
from tests.servers import ServerProcess

ROWS = 64  # 64 KiB per request, 2.5 KiB per response
SENT = 3000
# Both transports stall well before SENT: the stream window, then what the transports buffer
# (observed: about 870 answered requests on HTTP/3, about 1,700 on HTTP/2).
STALLED_BELOW = 2500
STILL_SAMPLES = 10
DISTINCT = 7  # different inputs, taken in turn
RSS_GROWTH_LIMIT = 64 << 20  # reading all of SENT would hold 190 MiB of requests


async def _answered(server: ServerProcess) -> int:
    """Requests of the stream's model the server has run: it reads a request only to run it."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="mlp"), timeout=10)
        return sum(s.inference_stats.success.count for s in stats.model_stats)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


async def test_stream_client_that_does_not_read_stops_being_read(
    make_channel: ChannelFactory, conformance_server: ServerProcess
) -> None:
    # Request i sends inputs[i % DISTINCT]: answers that changed places fail their check.
    rng = np.random.default_rng(0)
    inputs = [{"input": rng.random((ROWS, 256), np.float32)} for _ in range(DISTINCT)]
    expected = [run_reference("mlp", x) for x in inputs]
    requests = [build_request("mlp", inputs[i % DISTINCT], request_id=str(i)) for i in range(SENT)]
    pid = conformance_server.process.pid

    before = await _answered(conformance_server)
    rss_before = _rss(pid)
    async with make_channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer(timeout=120)
        written = 0

        async def write_all() -> None:
            nonlocal written
            for request in requests:
                await call.write(request)
                written += 1
            await call.done_writing()

        writer = asyncio.create_task(write_all())
        # Until neither the client's writes nor the server's reads move for a while.
        samples: list[tuple[int, int]] = []
        while len(samples) < STILL_SAMPLES or len(set(samples[-STILL_SAMPLES:])) > 1:
            assert not writer.done(), "the server read every request"
            await asyncio.sleep(0.05)
            samples.append((written, await _answered(conformance_server) - before))
        answered = samples[-1][1]
        assert 0 < answered < STALLED_BELOW
        assert written < SENT and not writer.done()
        assert _rss(pid) - rss_before < RSS_GROWTH_LIMIT

        ids = set()
        async for response in call:
            assert response.error_message == ""
            ids.add(response.infer_response.id)
            assert_outputs(
                expected[int(response.infer_response.id) % DISTINCT], response.infer_response
            )
        await writer
        assert ids == {str(i) for i in range(SENT)}
        assert await call.code() == grpc.StatusCode.OK
