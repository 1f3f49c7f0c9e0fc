"""Attacks on streaming generation (the `generate` example, a decoupled model): a storm of
streams cancelled after their first token, clients that start generations and never read
them, and the generation worker killed mid-generation. Each checks, from the server's own
metrics, that the model's work stopped with the stream."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
import urllib.request
from typing import Any

from clients.generation import generation_request
from clients.streaming import parse_stream_response
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.chaos.harness import (
    GENERATION_MODEL,
    TRANSPORTS,
    AttackResult,
    Scale,
    Target,
    status_name,
)
from tests.chaos.workers import RESTART_LIMIT_S, _replaced, _signal_worker, _victim

PROMPT = "Once upon a time"
LONG_MAX_TOKENS = 10_000  # far more than any of these streams lives for
STORM_PARALLEL = 8  # streams in flight at once per transport
CALL_TIMEOUT_S = 60.0
SETTLE_LIMIT_S = 60.0
POLL_S = 0.05
# A never-read generation may run ahead of its reader by the worker's window of responses
# plus what the transports buffer (flow-control windows of small messages): far fewer tokens
# than it asked for.
HELD_TOKEN_LIMIT = LONG_MAX_TOKENS // 4
HOLD_CHECK_S = 1.0


def _request(max_tokens: int, request_id: str = "") -> Any:
    return generation_request(GENERATION_MODEL, PROMPT, max_tokens, request_id=request_id).message()


def _metric(target: Target, name: str) -> float:
    with urllib.request.urlopen(target.metrics_url, timeout=10) as response:
        text = response.read().decode()
    found = re.search(rf'^{name}\{{model="{GENERATION_MODEL}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def _metric_async(target: Target, name: str) -> float:
    return await asyncio.to_thread(_metric, target, name)


async def _settled(target: Target) -> tuple[bool, float]:
    """Whether the model's active generations fell to zero (bounded wait), and the generated
    token counter then."""
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while await _metric_async(target, "paddlequic_active_generations") > 0:
        if time.monotonic() > deadline:
            return False, await _metric_async(target, "paddlequic_generated_tokens_total")
        await asyncio.sleep(POLL_S)
    return True, await _metric_async(target, "paddlequic_generated_tokens_total")


async def _first_token_then_cancel(stub: pb_grpc.GRPCInferenceServiceStub) -> str:
    call = stub.ModelStreamInfer(timeout=CALL_TIMEOUT_S)
    try:
        await call.write(_request(LONG_MAX_TOKENS))
        response = parse_stream_response(await call.read())
        if response.error is not None:
            return response.error.split(":", 1)[0]
        return "cancelled after a token"
    except Exception as exc:
        return status_name(exc)
    finally:
        call.cancel()


async def _gated(gate: asyncio.Semaphore, stub: pb_grpc.GRPCInferenceServiceStub) -> str:
    async with gate:
        return await _first_token_then_cancel(stub)


async def cancelled_stream_storm(target: Target, scale: Scale) -> AttackResult:
    """`generation_storm` streams per transport, a few at a time, each cancelled as soon as
    its first token came: afterwards no generation may be left running, and each cancelled
    one may have produced only a few tokens."""
    result = AttackResult()
    _, before = await _settled(target)
    for transport in TRANSPORTS:
        async with target.channel(transport) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            gate = asyncio.Semaphore(STORM_PARALLEL)
            outcomes = await asyncio.gather(
                *(_gated(gate, stub) for _ in range(scale.generation_storm))
            )
            result.outcomes.update(f"{transport} {outcome}" for outcome in outcomes)
    settled, after = await _settled(target)
    if not settled:
        result.problems.append("generations still active after every stream was cancelled")
    streams = len(TRANSPORTS) * scale.generation_storm
    result.notes["tokens_per_cancelled_stream"] = round((after - before) / streams, 1)
    if after - before > streams * HELD_TOKEN_LIMIT:
        result.problems.append(f"{after - before:.0f} tokens for {streams} cancelled streams")
    return result


async def never_reading_generations(target: Target, scale: Scale) -> AttackResult:
    """`never_reading` streams per transport each start a long generation and never read a
    response. After `stream_s` the generations must be held (still active, their token count
    well short of what they asked for and not growing), then cancelled, after which none may
    be left running."""
    result = AttackResult()
    _, before = await _settled(target)
    async with contextlib.AsyncExitStack() as stack:
        calls = []
        for transport in TRANSPORTS:
            channel = await stack.enter_async_context(target.channel(transport))
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for index in range(scale.never_reading):
                call = stub.ModelStreamInfer(timeout=scale.stream_s * 10 + CALL_TIMEOUT_S)
                calls.append((transport, call))
                await call.write(_request(LONG_MAX_TOKENS, f"{transport}-{index}"))
        await asyncio.sleep(scale.stream_s)
        held = await _metric_async(target, "paddlequic_generated_tokens_total")
        await asyncio.sleep(HOLD_CHECK_S)
        still = await _metric_async(target, "paddlequic_generated_tokens_total")
        active = await _metric_async(target, "paddlequic_active_generations")
        for transport, call in calls:
            outcome = "held, never read" if not call.done() else f"ended {await call.code()}"
            result.outcomes[f"{transport} {outcome}"] += 1
            call.cancel()
    result.notes["tokens_while_held"] = held - before
    if still != held:
        result.problems.append(f"never-read generations kept going: {held:.0f} -> {still:.0f}")
    if active < len(calls):
        result.problems.append(f"only {active:.0f} of {len(calls)} never-read generations active")
    if held - before > len(calls) * HELD_TOKEN_LIMIT:
        result.problems.append(f"{held - before:.0f} tokens for {len(calls)} never-read streams")
    settled, _ = await _settled(target)
    if not settled:
        result.problems.append("generations still active after the never-read streams closed")
    return result


async def _read_to_end(call: Any) -> tuple[int, str]:
    """Tokens read, and how the request ended: OK, or its error's status name."""
    tokens = 0
    try:
        async for message in call:
            response = parse_stream_response(message)
            if response.error is not None:
                return tokens, response.error.split(":", 1)[0]
            tokens += bool(response.outputs.get("text_delta") is not None)
            if response.final:
                return tokens, "OK"
    except Exception as exc:
        return tokens, status_name(exc)
    return tokens, "stream ended without a final response"


async def generation_worker_kill(target: Target, scale: Scale) -> AttackResult:
    """Generations on both transports, each past its first token, when the generation worker
    is SIGKILLed: each must end with a clear UNAVAILABLE (responses were delivered, so it
    cannot run again), the worker be replaced, and a new generation then succeed."""
    result = AttackResult()
    for _ in range(scale.generation_kills):
        async with contextlib.AsyncExitStack() as stack:
            calls = []
            for transport in TRANSPORTS:
                channel = await stack.enter_async_context(target.channel(transport))
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                call = stub.ModelStreamInfer(timeout=RESTART_LIMIT_S + CALL_TIMEOUT_S)
                # Not read past its first token: held by back-pressure until the kill.
                await call.write(_request(LONG_MAX_TOKENS, transport))
                first = parse_stream_response(await call.read())
                if first.error is not None or first.final:
                    result.problems.append(f"{transport}: no first token ({first.error})")
                calls.append((transport, call))
            victim = await _victim(target, GENERATION_MODEL)
            if not _signal_worker(target, victim.pid, signal.SIGKILL):
                result.problems.append(f"worker {victim.pid} vanished before the kill")
                continue
            result.outcomes["killed"] += 1
            for transport, call in calls:
                _, outcome = await _read_to_end(call)
                result.outcomes[f"{transport} {outcome}"] += 1
                with contextlib.suppress(Exception):
                    await call.done_writing()
        if not await _replaced(target, victim, RESTART_LIMIT_S, GENERATION_MODEL):
            result.problems.append(f"killed worker not replaced within {RESTART_LIMIT_S} s")
            continue
        result.outcomes["replaced"] += 1
        async with target.channel("h2") as channel:
            call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                timeout=CALL_TIMEOUT_S
            )
            await call.write(_request(4))
            await call.done_writing()
            tokens, outcome = await _read_to_end(call)
        result.outcomes[f"after restart {outcome}"] += 1
        if outcome != "OK" or tokens == 0:
            result.problems.append(f"a generation after the restart got {outcome}")
    return result
