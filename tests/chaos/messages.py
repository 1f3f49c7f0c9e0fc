"""Attacks with one abusive request: oversized messages, metadata bombs and BYTES element
bombs, on both transports."""

from __future__ import annotations

import asyncio
import contextlib
import struct

import grpc
import numpy as np

from clients.inference_client import build_request
from oip.bytes_tensor import serialize_bytes
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.chaos.harness import (
    BYTES_MODEL,
    MAX_MESSAGE,
    TRANSPORTS,
    AttackResult,
    Scale,
    Target,
    outcome_of,
    status_name,
)
from transport.grpc import headers as wire
from transport.h3.client import H3ClientConnection, client_configuration
from transport.h3.stream_state import StreamClosed

CALL_TIMEOUT_S = 30.0
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
ANNOUNCED_BYTES = 100 << 20  # what the HTTP/3 prefix claims
SENT_BYTES = 256 << 10  # what follows it
H2_OVERSIZED_BYTES = MAX_MESSAGE + (1 << 20)
BOMB_ENTRIES = 1024
POLL_S = 0.01
ANSWER_TIMEOUT_S = 5.0  # a status for a refused message is due at once
BOMB_VALUE_BYTES = 1024  # 1024 entries of 1 KiB: 1 MiB of metadata
# A [1, 1] BYTES tensor carrying 3 MiB of 2-byte elements (a new object each, were they
# listed): the shape declares one element.
ELEMENT_BOMB_ELEMENTS = 525_000


async def _h3_announced_oversize(target: Target) -> str:
    """A raw HTTP/3 request whose 5-byte prefix announces 100 MiB, followed by some of it;
    the status the server answers with. The server may also stop our sending (STOP_SENDING):
    that fails our stream locally, so its headers are looked at directly, not awaited."""
    configuration = client_configuration("localhost", str(target.ca_file))
    connection = await H3ClientConnection.connect("127.0.0.1", target.port, configuration)
    try:
        await asyncio.wait_for(connection.wait_connected(), CALL_TIMEOUT_S)
        stream = connection.open_stream()
        stream.send_headers(wire.request_headers(target.address, MODEL_INFER, None))
        with contextlib.suppress(StreamClosed):
            await stream.send_data(struct.pack(">BI", 0, ANNOUNCED_BYTES) + bytes(SENT_BYTES))
        deadline = asyncio.get_running_loop().time() + ANSWER_TIMEOUT_S
        while asyncio.get_running_loop().time() < deadline and connection.usable:
            answer = stream.trailers or stream.headers
            if answer is not None and wire.is_trailers_only(answer):
                return wire.parse_trailers(answer).code.name
            await asyncio.sleep(POLL_S)
        return "no answer" if connection.usable else "refused at transport"
    except Exception as exc:
        return status_name(exc)
    finally:
        await connection.close()


async def oversized_messages(target: Target, scale: Scale) -> AttackResult:
    """HTTP/3: a prefix announcing 100 MiB; HTTP/2: a real message 1 MiB over the limit.
    RESOURCE_EXHAUSTED expected."""
    result = AttackResult()
    big = pb.ModelInferRequest(
        model_name="mlp",
        inputs=[pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32")],
        raw_input_contents=[bytes(H2_OVERSIZED_BYTES)],
    )
    options = [("grpc.max_send_message_length", 2 * H2_OVERSIZED_BYTES)]
    async with grpc.aio.insecure_channel(target.address, options=options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(scale.oversized):
            call = stub.ModelInfer(big, timeout=CALL_TIMEOUT_S)
            result.outcomes["h2 " + await outcome_of(call, CALL_TIMEOUT_S)] += 1
    del big
    for _ in range(scale.oversized):
        result.outcomes["h3 " + await _h3_announced_oversize(target)] += 1
    return result


async def metadata_bombs(target: Target, scale: Scale) -> AttackResult:
    """ModelInfer carrying 1 MiB of metadata: a clear refusal expected."""
    result = AttackResult()
    request = build_request("mlp", {"input": np.zeros((1, 256), np.float32)})
    bomb = tuple((f"x-bomb-{i}", "b" * BOMB_VALUE_BYTES) for i in range(BOMB_ENTRIES))
    for transport in TRANSPORTS:
        async with target.channel(transport) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for _ in range(scale.bombs):
                call = stub.ModelInfer(request, metadata=bomb, timeout=CALL_TIMEOUT_S)
                result.outcomes[f"{transport} " + await outcome_of(call, CALL_TIMEOUT_S)] += 1
    return result


async def bytes_element_bombs(target: Target, scale: Scale) -> AttackResult:
    """ModelInfer on the BYTES model declaring shape [1, 1] and sending 525,000 elements:
    INVALID_ARGUMENT expected, after reading one element's length and the bytes that follow,
    not a list of every element."""
    result = AttackResult()
    request = pb.ModelInferRequest(model_name=BYTES_MODEL)
    request.inputs.add(name="text", datatype="BYTES", shape=[1, 1])
    request.raw_input_contents.append(serialize_bytes([b"ab"] * ELEMENT_BOMB_ELEMENTS))
    for transport in TRANSPORTS:
        async with target.channel(transport) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for _ in range(scale.element_bombs):
                call = stub.ModelInfer(request, timeout=CALL_TIMEOUT_S)
                result.outcomes[f"{transport} " + await outcome_of(call, CALL_TIMEOUT_S)] += 1
    return result
