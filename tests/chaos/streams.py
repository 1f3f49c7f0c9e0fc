"""Attacks by not reading: streams whose responses are never read (both transports) and an
HTTP/3 client that reads a large response very slowly."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
from grpc.aio import AioRpcError

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1 import control_pb2, control_pb2_grpc, testing_pb2, testing_pb2_grpc
from tests.chaos.harness import TRANSPORTS, AttackResult, Scale, Target, status_name

STREAM_ROWS = 64
SLOW_READ_INTERVAL_S = 0.1
SLOW_RESPONSES = 400
SLOW_RESPONSE_BYTES = 256 << 10


async def never_reading_streams(target: Target, scale: Scale) -> AttackResult:
    """A ModelStreamInfer stream per transport that writes 64-row requests and never reads a
    response, until `stream_requests` are written or `stream_s` passed; then it is cancelled.
    A bounded server stops taking requests (flow control) or refuses the stream."""
    result = AttackResult()
    request = build_request("mlp", {"input": np.ones((STREAM_ROWS, 256), np.float32)})
    loop = asyncio.get_running_loop()
    for transport in TRANSPORTS:
        async with target.channel(transport) as channel:
            call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                timeout=scale.stream_s * 4
            )
            deadline = loop.time() + scale.stream_s
            written = 0
            try:
                while written < scale.stream_requests:
                    await asyncio.wait_for(call.write(request), max(deadline - loop.time(), 0))
                    written += 1
                outcome = "wrote all, never read"
            except TimeoutError:
                outcome = "writes held back by flow control"
            except Exception as exc:
                outcome = status_name(exc)
            call.cancel()
            result.outcomes[f"{transport} {outcome}"] += 1
            result.notes[f"{transport}_requests_written"] = written
    return result


async def slow_reader(target: Target, scale: Scale) -> AttackResult:
    """Testing.ServerStream of 100 MiB read one message per 0.1 s for `slow_read_s`, then
    cancelled: the server must hold back (flow control), not buffer the rest."""
    result = AttackResult()
    request = testing_pb2.EchoRequest(
        response_count=SLOW_RESPONSES, response_size=SLOW_RESPONSE_BYTES
    )
    loop = asyncio.get_running_loop()
    async with target.channel("h3") as channel:
        call = testing_pb2_grpc.TestingStub(channel).ServerStream(
            request, timeout=scale.slow_read_s * 4
        )
        deadline = loop.time() + scale.slow_read_s
        read = 0
        try:
            while loop.time() < deadline:
                await asyncio.wait_for(call.read(), scale.slow_read_s)
                read += 1
                await asyncio.sleep(SLOW_READ_INTERVAL_S)
            outcome = "read slowly, then cancelled"
        except AioRpcError as exc:
            outcome = exc.code().name
        except Exception as exc:
            outcome = status_name(exc)
        call.cancel()
    result.outcomes[outcome] += 1
    result.notes["messages_read"] = read
    async with grpc.aio.insecure_channel(target.address) as channel:
        stats = await control_pb2_grpc.ControlStub(channel).TransportStats(
            control_pb2.TransportStatsRequest(), timeout=10
        )
    result.notes["h3_peak_send_buffered_bytes"] = stats.h3_peak_send_buffered
    return result
