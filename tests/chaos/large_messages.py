"""Large HTTP/3 messages in many DATA frames, as libcurl sends a body: Testing/Unary calls
whose payload (echoed in the response) puts both directions between one and two stream
windows, the sizes where credit once ran out a few bytes or half a window short. (ModelInfer's
request id once carried the size; ids are now bounded, service/api/wire_limits.py.)"""

from __future__ import annotations

import asyncio

import grpc

from protos.paddlequic.v1 import testing_pb2 as pb
from tests.chaos.harness import AttackResult, Scale, Target, status_name
from tests.framed_h3 import STREAM_WINDOW, framed_call
from transport.grpc.framing import encode_message

UNARY = "/paddlequic.v1.Testing/Unary"  # the chaos server runs --testing-service
CALL_TIMEOUT_S = 60.0
PAYLOAD_SIZES = (STREAM_WINDOW * 6 // 5, STREAM_WINDOW * 7 // 5, 2 * STREAM_WINDOW)
# (first DATA frame, the others): one frame; libcurl's 64 KiB; 16 KiB, the first ending
# inside the 5-byte prefix.
FRAMINGS = ((1 << 30, 1 << 30), (5, 64 << 10), (3, 16 << 10))


async def _call(target: Target, size: int, head: int, chunk: int) -> str:
    payload = b"r" * size
    body = encode_message(pb.EchoRequest(payload=payload).SerializeToString())
    try:
        answer = await asyncio.wait_for(
            framed_call("127.0.0.1", target.port, str(target.ca_file), UNARY, body, head, chunk),
            CALL_TIMEOUT_S,
        )
    except Exception as exc:
        return status_name(exc)
    if answer.status is not grpc.StatusCode.OK:
        return answer.status.name
    responses = [pb.EchoResponse.FromString(r) for r in answer.responses]
    if [r.payload == payload for r in responses] != [True]:
        return "wrong answer"
    return "OK"


async def many_data_frames(target: Target, scale: Scale) -> AttackResult:
    """Every size in every framing, one call after another, `large_messages` rounds."""
    result = AttackResult()
    for _ in range(scale.large_messages):
        for size in PAYLOAD_SIZES:
            for head, chunk in FRAMINGS:
                result.outcomes["h3 " + await _call(target, size, head, chunk)] += 1
    return result
