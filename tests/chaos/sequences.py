"""An attack on sequence batching (the `kws` example, a stateful model): a flood of sequences
started and abandoned, more than the model may hold, and requests for sequences that never
started. The live-sequence bound must refuse the excess at once, and every abandoned sequence
must be released by its idle timeout: nothing an attacker starts stays held."""

from __future__ import annotations

import asyncio
import random
import re
import time
import urllib.request

import numpy as np

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.chaos.harness import (
    SEQUENCE_MODEL,
    TRANSPORTS,
    AttackResult,
    Scale,
    Target,
    outcomes_of,
)

CONCURRENCY = 32
CALL_TIMEOUT_S = 30.0
# kws's max_sequence_idle_microseconds is 5 s: every abandoned sequence is gone well before.
RELEASE_LIMIT_S = 30.0


def _live(target: Target) -> float:
    with urllib.request.urlopen(target.metrics_url, timeout=10) as response:
        text = response.read().decode()
    found = re.findall(
        rf'^paddlequic_live_sequences\{{model="{SEQUENCE_MODEL}",version="\d+"\}} (\S+)$',
        text,
        re.M,
    )
    return sum(float(v) for v in found)


async def abandoned_sequences(target: Target, scale: Scale) -> AttackResult:
    """Each call starts a sequence with a random id and never sends another request; every
    fourth asks for a sequence that was never started."""
    result = AttackResult()
    chunk = np.zeros((1, 8, 40), np.float32)
    rng = random.Random(24)
    for transport in TRANSPORTS:
        async with target.channel(transport) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            calls = (
                stub.ModelInfer(
                    build_request(
                        SEQUENCE_MODEL,
                        {"features": chunk},
                        parameters={
                            "sequence_id": rng.getrandbits(62) + 1,
                            "sequence_start": index % 4 != 0,
                        },
                    ),
                    timeout=CALL_TIMEOUT_S,
                )
                for index in range(scale.abandoned_sequences)
            )
            result.outcomes.update(await outcomes_of(calls, CONCURRENCY, CALL_TIMEOUT_S))
    result.notes["live_sequences_after_flood"] = await asyncio.to_thread(_live, target)
    deadline = time.monotonic() + RELEASE_LIMIT_S
    while (live := await asyncio.to_thread(_live, target)) > 0:
        if time.monotonic() > deadline:
            result.problems.append(f"{live:.0f} abandoned sequences still held after idle timeout")
            break
        await asyncio.sleep(0.2)
    if "RESOURCE_EXHAUSTED" not in result.outcomes:
        result.problems.append("the live-sequence bound never refused a start")
    return result
