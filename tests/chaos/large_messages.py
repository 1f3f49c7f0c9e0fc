"""Large HTTP/3 messages in many DATA frames, as libcurl sends a body: ModelInfer requests
whose `id` (echoed in the response) puts both directions between one and two stream windows,
the sizes where credit once ran out a few bytes or half a window short."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from tests.chaos.harness import GOOD_MODEL, AttackResult, Scale, Target, status_name
from tests.framed_h3 import STREAM_WINDOW, framed_call
from transport.grpc.framing import encode_message

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
CALL_TIMEOUT_S = 60.0
ID_SIZES = (STREAM_WINDOW * 6 // 5, STREAM_WINDOW * 7 // 5, 2 * STREAM_WINDOW)
# (first DATA frame, the others): one frame; libcurl's 64 KiB; 16 KiB, the first ending
# inside the 5-byte prefix.
FRAMINGS = ((1 << 30, 1 << 30), (5, 64 << 10), (3, 16 << 10))


async def _call(target: Target, id_size: int, head: int, chunk: int) -> str:
    request_id = "r" * id_size
    request = build_request(GOOD_MODEL, {"input": np.ones((1, 256), np.float32)})
    request.id = request_id
    body = encode_message(request.SerializeToString())
    try:
        answer = await asyncio.wait_for(
            framed_call(
                "127.0.0.1", target.port, str(target.ca_file), MODEL_INFER, body, head, chunk
            ),
            CALL_TIMEOUT_S,
        )
    except Exception as exc:
        return status_name(exc)
    if answer.status is not grpc.StatusCode.OK:
        return answer.status.name
    responses = [pb.ModelInferResponse.FromString(r) for r in answer.responses]
    if [(r.id == request_id, len(r.raw_output_contents)) for r in responses] != [(True, 1)]:
        return "wrong answer"
    return "OK"


async def many_data_frames(target: Target, scale: Scale) -> AttackResult:
    """Every size in every framing, one call after another, `large_messages` rounds."""
    result = AttackResult()
    for _ in range(scale.large_messages):
        for id_size in ID_SIZES:
            for head, chunk in FRAMINGS:
                result.outcomes["h3 " + await _call(target, id_size, head, chunk)] += 1
    return result
