"""Attacks with requests that are cheap to send and would be dear to take in: gzip bombs and a
flood of request messages that are not protobuf, on both transports."""

from __future__ import annotations

import asyncio
import contextlib
import zlib

import grpc

from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.chaos.harness import (
    MAX_MESSAGE,
    TRANSPORTS,
    AttackResult,
    Scale,
    Target,
    outcome_of,
    outcomes_of,
    status_name,
)
from transport.grpc import headers as wire
from transport.h3.client import H3ClientConnection, client_configuration
from transport.h3.stream_state import StreamClosed

CALL_TIMEOUT_S = 30.0
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
BOMB_BYTES = 4 * MAX_MESSAGE  # what the bomb inflates to: far past --max-message-bytes
# grpcio compresses the H2 bomb itself, so it must be allowed to send the inflated size.
H2_BOMBER = [("grpc.max_send_message_length", 2 * BOMB_BYTES)]
# Field 1 (model_name) announcing 2 GiB of a string that never comes.
GARBAGE = b"\x0a\xff\xff\xff\xff\x07abc"
CONCURRENCY = 16
# Unparsable requests are logged within a budget (a burst per transport, RPC and status, then
# about a line a second): the flood may add this share of a line per request at most.
LOG_LINES_PER_REQUEST = 0.1


def gzip_bomb(size: int) -> bytes:
    """`size` zero bytes as gzip, built a MiB at a time: some 1000 times smaller."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    parts = [compressor.compress(zeros) for _ in range(size >> 20)]
    return b"".join([*parts, compressor.compress(bytes(size % (1 << 20))), compressor.flush()])


async def _h3_bomb(target: Target, bomb: bytes) -> str:
    """One ModelInfer whose only message is `bomb`, flagged gzip-compressed; the status."""
    configuration = client_configuration("localhost", str(target.ca_file))
    connection = await H3ClientConnection.connect("127.0.0.1", target.port, configuration)
    try:
        await asyncio.wait_for(connection.wait_connected(), CALL_TIMEOUT_S)
        stream = connection.open_stream()
        headers = wire.request_headers(target.address, MODEL_INFER, CALL_TIMEOUT_S)
        stream.send_headers([*headers, (b"grpc-encoding", b"gzip")])
        with contextlib.suppress(StreamClosed):  # the server may stop the upload at once
            await stream.send_data(b"\x01" + len(bomb).to_bytes(4, "big") + bomb, end=True)
        block = await asyncio.wait_for(stream.wait_headers(), CALL_TIMEOUT_S)
        if not wire.is_trailers_only(block):
            return "answered with messages"
        return wire.parse_trailers(block).code.name
    except Exception as exc:
        return status_name(exc)
    finally:
        await connection.close()


async def gzip_bombs(target: Target, scale: Scale) -> AttackResult:
    """Some 64 KiB of gzip inflating to four times --max-message-bytes: RESOURCE_EXHAUSTED,
    and the server's memory (the row's RSS goal) shows it was never inflated whole."""
    result = AttackResult()
    request = pb.ModelInferRequest(
        model_name="mlp",
        inputs=[pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32")],
        raw_input_contents=[bytes(BOMB_BYTES)],
    )
    async with grpc.aio.insecure_channel(target.address, options=H2_BOMBER) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(scale.gzip_bombs):
            call = stub.ModelInfer(
                request, compression=grpc.Compression.Gzip, timeout=CALL_TIMEOUT_S
            )
            result.outcomes["h2 " + await outcome_of(call, CALL_TIMEOUT_S)] += 1
    bomb = gzip_bomb(BOMB_BYTES)
    del request
    result.notes["bomb_bytes"] = len(bomb)
    for _ in range(scale.gzip_bombs):
        result.outcomes["h3 " + await _h3_bomb(target, bomb)] += 1
    return result


def _log_lines(target: Target) -> int:
    with target.log_path.open("rb") as log:
        return sum(1 for _ in log)


async def malformed_flood(target: Target, scale: Scale) -> AttackResult:
    """ModelInfer requests that are not protobuf, `scale.malformed` per transport, 16 at a
    time: INVALID_ARGUMENT each, and the server log grows by a bounded number of lines (not a
    traceback per request, as grpcio logged)."""
    result = AttackResult()
    lines_before = _log_lines(target)
    for transport in TRANSPORTS:
        async with target.channel(transport) as channel:
            infer = channel.unary_unary(MODEL_INFER, None, None)
            calls = (infer(GARBAGE, timeout=CALL_TIMEOUT_S) for _ in range(scale.malformed))
            outcomes = await outcomes_of(calls, CONCURRENCY, CALL_TIMEOUT_S)
            result.outcomes.update(f"{transport} {o}" for o in outcomes)
    growth = _log_lines(target) - lines_before
    limit = LOG_LINES_PER_REQUEST * scale.malformed * len(TRANSPORTS)
    result.notes["log_growth_lines"] = growth
    if growth > limit:
        result.problems.append(
            f"the server log grew by {growth} lines for {scale.malformed} unparsable requests "
            f"per transport (limit {limit:.0f})"
        )
    return result
