"""Attacks on streaming generation (the `generate` example, a decoupled model): a storm of
streams cancelled after their first token, clients that start generations and never read
them (while another caller must keep being served), a large request id repeated in every
token response of a stream nobody reads, and the generation worker killed mid-generation.
Each checks, from the server's own metrics, that the model's work stopped with the
stream."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
import urllib.request
from typing import Any

from grpc.aio import EOF  # type: ignore[attr-defined]

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
LONG_MAX_TOKENS = 200  # near the model's context (257 tokens with the prompt)
STORM_PARALLEL = 8  # streams in flight at once per transport
CALL_TIMEOUT_S = 60.0
OPEN_CIRCUIT_RETRY_S = 0.5  # a breaker open after the kills: asked again this often
SETTLE_LIMIT_S = 60.0
POLL_S = 0.05
HOLD_CHECK_S = 1.0  # the token counter unchanged this long: every generation finished or held
# A never-reading client's request ids: each token response repeats its id, so a few hundred
# tokens fill the transports' flow-control windows and its generations are held.
HOG_ID_BYTES = 256  # the bound on ids
GOOD_MAX_TOKENS = 8
GOOD_GENERATIONS = 2  # per transport, while never-read generations are held
# A large id that is allowed (the message stays far below the chaos server's limit); 65
# token responses of it held for one stream would be 65 MiB.
LARGE_ID_BYTES = 1 << 20


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
    per_stream = (after - before) / streams
    result.notes["tokens_per_cancelled_stream"] = round(per_stream, 1)
    # Cancelled after one token, a generation stops within a few decode steps; one that ran
    # on would make about LONG_MAX_TOKENS.
    if per_stream > LONG_MAX_TOKENS / 2:
        result.problems.append(f"{per_stream:.0f} tokens per stream cancelled after one")
    return result


async def _quiet(target: Target, limit_s: float) -> tuple[bool, float]:
    """Until the generated-token counter stays unchanged for HOLD_CHECK_S (bounded): whether
    it did, and its value."""
    deadline = time.monotonic() + limit_s
    last = await _metric_async(target, "paddlequic_generated_tokens_total")
    while time.monotonic() < deadline:
        await asyncio.sleep(HOLD_CHECK_S)
        now = await _metric_async(target, "paddlequic_generated_tokens_total")
        if now == last:
            return True, now
        last = now
    return False, last


async def _write_generations(call: Any, count: int, prefix: str) -> None:
    with contextlib.suppress(Exception):  # the stream is cancelled while writes wait
        for index in range(count):
            await call.write(_request(LONG_MAX_TOKENS, f"{prefix}-{index}".ljust(HOG_ID_BYTES)))


async def _good_generations(target: Target, result: AttackResult) -> None:
    """GOOD_GENERATIONS generations of another caller per transport, one after another: each
    must get all its tokens (never-read generations hold no batch slot for long)."""
    for _ in range(GOOD_GENERATIONS):
        for transport in TRANSPORTS:
            async with target.channel(transport) as channel:
                call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                    timeout=CALL_TIMEOUT_S
                )
                await call.write(_request(GOOD_MAX_TOKENS, f"good-{transport}"))
                await call.done_writing()
                tokens, outcome = await _read_to_end(call)
            result.outcomes[f"{transport} good generation {outcome}"] += 1
            if outcome != "OK" or tokens != GOOD_MAX_TOKENS:
                result.problems.append(
                    f"a good generation on {transport} got {tokens} token(s), {outcome}"
                )


async def never_reading_generations(target: Target, scale: Scale) -> AttackResult:
    """`never_reading` streams per transport, each writing `never_read_generations` long
    generations (ids of HOG_ID_BYTES, so the transports' windows fill) and never reading a
    response. Once their generations are held (the token counter at rest), another caller's
    generations must get all their tokens: the never-read ones are cancelled at the server's
    stall bound (--stream-stall-timeout), and no generation may be left running while their
    streams stay open. The RSS goal bounds what the server buffered meanwhile."""
    result = AttackResult()
    _, before = await _settled(target)
    limit_s = scale.attack_limit_s / 2
    async with contextlib.AsyncExitStack() as stack:
        calls, writers = [], []
        for transport in TRANSPORTS:
            channel = await stack.enter_async_context(target.channel(transport))
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for index in range(scale.never_reading):
                call = stub.ModelStreamInfer(timeout=limit_s * 2 + CALL_TIMEOUT_S)
                calls.append((transport, call))
                count, prefix = scale.never_read_generations, f"{transport}-{index}"
                writers.append(asyncio.create_task(_write_generations(call, count, prefix)))
        quiet, held = await _quiet(target, limit_s)
        await _good_generations(target, result)
        settled, _ = await _settled(target)  # the never-read streams still open
        for transport, call in calls:
            outcome = "held, never read" if not call.done() else f"ended {await call.code()}"
            result.outcomes[f"{transport} {outcome}"] += 1
            call.cancel()
        await asyncio.gather(*writers)
    asked = len(calls) * scale.never_read_generations
    result.notes["tokens_while_held"] = held - before
    if not quiet:
        result.problems.append(f"never-read generations still running after {limit_s:.0f} s")
    if not settled:
        result.problems.append("never-read generations still held while their streams are open")
    if held - before > asked * (LONG_MAX_TOKENS + 1):
        result.problems.append(f"{held - before:.0f} tokens for {asked} generations")
    return result


async def large_id_amplification(target: Target, scale: Scale) -> AttackResult:
    """A generation whose request id is LARGE_ID_BYTES, which every token response would
    repeat, from a client that never reads, one transport after the other: the id is refused
    at its bound (256 bytes) before the request is parsed, and nothing is generated for it."""
    result = AttackResult()
    for transport in TRANSPORTS:
        async with target.channel(transport) as channel:
            call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                timeout=scale.attack_limit_s + CALL_TIMEOUT_S
            )
            await call.write(_request(LONG_MAX_TOKENS, "x" * LARGE_ID_BYTES))
            quiet, _ = await _quiet(target, scale.attack_limit_s / 2)
            # Read only for the stream's status (HTTP/3 delivers it when read): what came
            # before it, had the id been taken, would be tokens.
            outcome = "held, never read"
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    _, outcome = await _read_to_end(call)
            result.outcomes[f"{transport} {outcome}"] += 1
            call.cancel()
        if not quiet:
            result.problems.append(f"the {transport} generation never came to rest")
    settled, _ = await _settled(target)
    if not settled:
        result.problems.append("generations still active after the streams closed")
    return result


async def _read_to_end(call: Any) -> tuple[int, str]:
    """Tokens read, and how the request ended: OK, or its error's status name."""
    tokens, outcome, _ = await _ending(call)
    return tokens, outcome


async def _ending(call: Any) -> tuple[int, str, str]:
    """`_read_to_end`, and the error's words (empty unless it ended with one in the stream)."""
    tokens = 0
    try:  # read(), not async iteration: grpc.aio refuses a mix of the two on one call
        while (message := await call.read()) is not EOF:
            response = parse_stream_response(message)
            if response.error is not None:
                return tokens, response.error.split(":", 1)[0], response.error
            tokens += bool(response.outputs.get("text_delta") is not None)
            if response.final:
                return tokens, "OK", ""
    except Exception as exc:
        return tokens, status_name(exc), ""
    return tokens, "stream ended without a final response", ""


async def _generated_after_restart(target: Target) -> tuple[int, str]:
    """Tokens, and how a new generation ends, once the killed worker is back. The killed
    generations' UNAVAILABLE may have opened the model's breaker (as it should, when most of
    its recent requests failed: earlier rows' count too); then the generation is asked again
    once the breaker lets probes through, within RESTART_LIMIT_S: the row asks whether the
    model serves again, which the breaker's probes decide."""
    deadline = time.monotonic() + RESTART_LIMIT_S
    while True:
        async with target.channel("h2") as channel:
            call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                timeout=CALL_TIMEOUT_S
            )
            await call.write(_request(4))
            await call.done_writing()
            tokens, outcome, words = await _ending(call)
        if "open-circuited" not in words or time.monotonic() > deadline:
            return tokens, outcome
        await asyncio.sleep(OPEN_CIRCUIT_RETRY_S)


async def _started(stub: pb_grpc.GRPCInferenceServiceStub, request_id: str) -> tuple[Any, str]:
    """A generation past its first token (not read further: held by back-pressure), or what
    went wrong."""
    call = stub.ModelStreamInfer(timeout=RESTART_LIMIT_S + CALL_TIMEOUT_S)
    await call.write(_request(LONG_MAX_TOKENS, request_id))
    first = parse_stream_response(await call.read())
    return call, "" if first.error is None and not first.final else f"no first token: {first}"


async def generation_worker_kill(target: Target, scale: Scale) -> AttackResult:
    """A generation per transport, each past its first token, when the generation worker is
    SIGKILLed: each must end with a clear UNAVAILABLE (it had responses, so it cannot run
    again), the worker be replaced, and a new generation then succeed."""
    result = AttackResult()
    for _ in range(scale.generation_kills):
        victim = await _victim(target, GENERATION_MODEL)
        async with contextlib.AsyncExitStack() as stack:
            stubs = [
                pb_grpc.GRPCInferenceServiceStub(
                    await stack.enter_async_context(target.channel(transport))
                )
                for transport in TRANSPORTS
            ]
            pairs = zip(stubs, TRANSPORTS, strict=True)
            started = await asyncio.gather(*(_started(stub, t) for stub, t in pairs))
            if not _signal_worker(target, victim.pid, signal.SIGKILL):
                result.problems.append(f"worker {victim.pid} vanished before the kill")
                continue
            result.outcomes["killed"] += 1
            for transport, (call, problem) in zip(TRANSPORTS, started, strict=True):
                if problem:
                    result.problems.append(f"{transport}: {problem}")
                _, outcome = await _read_to_end(call)
                result.outcomes[f"{transport} {outcome}"] += 1
                call.cancel()
        if not await _replaced(target, victim, RESTART_LIMIT_S, GENERATION_MODEL):
            result.problems.append(f"killed worker not replaced within {RESTART_LIMIT_S} s")
            continue
        result.outcomes["replaced"] += 1
        tokens, outcome = await _generated_after_restart(target)
        result.outcomes[f"after restart {outcome}"] += 1
        if outcome != "OK" or tokens == 0:
            result.problems.append(f"a generation after the restart got {outcome}")
    return result
