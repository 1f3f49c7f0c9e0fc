"""Attacks on sequence batching (the `kws` example, a stateful model): a flood of sequences
started and abandoned, more than the model may hold, and requests for sequences that never
started. The live-sequence bound must refuse the excess at once, and every abandoned sequence
must be released by its idle timeout: nothing an attacker starts stays held. And callers naming
another caller's live sequence: none may run on its state, end it or restart it."""

from __future__ import annotations

import asyncio
import random
import re
import time
import urllib.request

import numpy as np

from clients.inference_client import build_request, parse_response
from clients.sequences import SequenceParameters, new_sequence_id
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.chaos.harness import (
    SEQUENCE_MODEL,
    TRANSPORTS,
    AttackResult,
    Scale,
    Target,
    outcomes_of,
)
from tests.reference import kws_reference

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


HIJACK_LENGTH = 4  # requests of each victim sequence
# (transport, certificate) of the callers that name the victim's sequence: another identity,
# and callers without a certificate on both transports (anyone: still not its owner).
INTRUDERS = (("h3", "intruder"), ("h3", ""), ("h2", ""))


async def sequence_hijack(target: Target, scale: Scale) -> AttackResult:
    """A victim with a client certificate runs kws sequences over HTTP/3 under random ids;
    between its requests, another certified caller and callers without a certificate (HTTP/2
    and HTTP/3, other connections) name its live sequence with a plain request, an end and a
    start, and guess ids. Each must be refused (NOT_FOUND; ALREADY_EXISTS for a start), and
    the victim's scores must be its sequences' run alone (float tolerance)."""
    result = AttackResult()
    rng = np.random.default_rng(42)
    victim = target.channel("h3", "victim")
    intruders = [target.channel(t, name) for t, name in INTRUDERS]
    try:
        victim_stub = pb_grpc.GRPCInferenceServiceStub(victim)
        stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in intruders]
        for _ in range(scale.hijacked_sequences):
            frames = [
                rng.standard_normal((1, 8, 40), dtype=np.float32) for _ in range(HIJACK_LENGTH)
            ]
            sequence = SequenceParameters()
            scores = []
            for index, chunk in enumerate(frames):
                request = build_request(
                    SEQUENCE_MODEL,
                    {"features": chunk},
                    parameters=sequence.next(end=index == HIJACK_LENGTH - 1),
                )
                response = await victim_stub.ModelInfer(request, timeout=CALL_TIMEOUT_S)
                scores.append(parse_response(response)["scores"])
                if index < HIJACK_LENGTH - 1:
                    calls = [
                        stub.ModelInfer(
                            build_request(SEQUENCE_MODEL, {"features": chunk}, parameters=flags),
                            timeout=CALL_TIMEOUT_S,
                        )
                        for stub in stubs
                        for flags in (
                            {"sequence_id": sequence.sequence_id},
                            {"sequence_id": sequence.sequence_id, "sequence_end": True},
                            {"sequence_id": sequence.sequence_id, "sequence_start": True},
                            {"sequence_id": new_sequence_id()},
                        )
                    ]
                    result.outcomes.update(await outcomes_of(calls, len(calls), CALL_TIMEOUT_S))
            expected = await asyncio.to_thread(kws_reference, frames)
            if not all(
                np.allclose(a, b, rtol=1e-4, atol=1e-6)
                for a, b in zip(scores, expected, strict=True)
            ):
                result.problems.append(
                    f"sequence {sequence.sequence_id}: the victim's scores are not its own"
                )
    finally:
        for channel in (victim, *intruders):
            await channel.close(None)
    result.notes["victim_sequences"] = scale.hijacked_sequences
    return result
