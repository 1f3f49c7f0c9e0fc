"""Attacks on the REST port, over raw HTTP/1.1 connections from another loopback address than
the good clients': slow clients that trickle their headers or their body a byte at a time,
bodies past --http-max-input-size (declared, and streamed in chunks), and storms of clients
that send an infer or a generate_stream request and vanish mid-request, before the answer or
mid-answer. Each checks that the server cut the attacker off within its bound and, for the
storms, that the generations of vanished clients stopped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable

from tests.chaos.floods import ATTACKER_HOST
from tests.chaos.generations import LONG_MAX_TOKENS, _settled
from tests.chaos.harness import (
    GENERATION_MODEL,
    GOOD_MODEL,
    HTTP_BODY_S,
    HTTP_KEEPALIVE_S,
    HTTP_MAX_INPUT,
    REFUSED,
    AttackResult,
    Scale,
    Target,
)

INFER_PATH = f"/v2/models/{GOOD_MODEL}/infer"
STREAM_PATH = f"/v2/models/{GENERATION_MODEL}/generate_stream"
TRICKLE_GAP_S = 0.1  # between a slow client's bytes
# A slow client cut off later than its bound by more than this is a problem (a busy 2-core
# machine delays the server's timers).
CUT_SLACK_S = 5.0
CHUNK = 1 << 20  # a streamed oversized body's chunks
PARALLEL = 16  # attacking connections at once
ANSWER_TIMEOUT_S = 30.0
# Outcomes
HEADERS_CUT = "headers: connection closed"
BODY_408 = "body: 408"
DECLARED_400 = "declared: 400"
STREAMED_400 = "streamed: 400"
STREAMED_REFUSED = f"streamed: {REFUSED}"
VANISHED = ("vanished mid-request", "vanished before the answer", "vanished mid-answer")


def _body() -> bytes:
    tensor = {"name": "input", "datatype": "FP32", "shape": [1, 256], "data": [0.5] * 256}
    return json.dumps({"inputs": [tensor]}).encode()


def _head(path: str, length: int | None, extra: str = "") -> bytes:
    size = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    return (
        f"POST {path} HTTP/1.1\r\nHost: chaos\r\nContent-Type: application/json\r\n"
        f"{size}\r\n{extra}\r\n"
    ).encode()


async def _open(target: Target) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(
        "127.0.0.1", target.http_port, local_addr=(ATTACKER_HOST, 0)
    )


async def _status(reader: asyncio.StreamReader) -> str:
    """The response's status code, or "connection closed" when the server closed without
    one."""
    line = await asyncio.wait_for(reader.readline(), ANSWER_TIMEOUT_S)
    if not line:
        return "connection closed"
    return line.split()[1].decode() if len(line.split()) > 1 else repr(line[:40])


async def _gated(gate: asyncio.Semaphore, work: Awaitable[str]) -> str:
    async with gate:
        return await work


async def _trickle(target: Target, part: str) -> tuple[str, float]:
    """One slow client: its request's headers (`part` "headers") or, its headers whole, its
    body a byte every TRICKLE_GAP_S; what it got and after how long."""
    body = _body()
    head = _head(INFER_PATH, len(body))
    reader, writer = await _open(target)
    started = time.monotonic()
    try:
        if part == "body":
            writer.write(head)
        for byte in head if part == "headers" else body:
            writer.write(bytes([byte]))
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                answered = await asyncio.wait_for(reader.readline(), TRICKLE_GAP_S)
                if not answered:
                    return f"{part}: connection closed", time.monotonic() - started
                return f"{part}: {answered.split()[1].decode()}", time.monotonic() - started
        return f"{part}: sent whole, never cut off", time.monotonic() - started
    except ConnectionError:
        return f"{part}: connection closed", time.monotonic() - started
    finally:
        writer.close()


async def slow_clients(target: Target, scale: Scale) -> AttackResult:
    """`slow_clients` connections trickling their headers and as many their bodies, at once:
    each must be cut off within its bound (the idle timeout for headers, the body timeout for
    a body, answered 408) and hold nothing afterwards."""
    result = AttackResult()
    parts = ["headers", "body"] * scale.slow_clients
    outcomes = await asyncio.gather(*(_trickle(target, part) for part in parts))
    bounds = {"headers": HTTP_KEEPALIVE_S, "body": HTTP_BODY_S}
    for part, bound in bounds.items():
        held = [seconds for p, (_, seconds) in zip(parts, outcomes, strict=True) if p == part]
        result.notes[f"longest_{part}_s"] = round(max(held), 1)
        late = [seconds for seconds in held if seconds > bound + CUT_SLACK_S]
        if late:
            result.problems.append(
                f"{len(late)} clients trickling their {part} were held up to {max(late):.1f} s "
                f"(bound {bound:g} s)"
            )
    result.outcomes.update(outcome for outcome, _ in outcomes)
    return result


async def _declared(target: Target) -> str:
    reader, writer = await _open(target)
    try:
        writer.write(_head(INFER_PATH, HTTP_MAX_INPUT + 1))
        await writer.drain()
        return f"declared: {await _status(reader)}"
    except ConnectionError:
        return "declared: connection closed"
    finally:
        writer.close()


async def _streamed(target: Target, result: AttackResult) -> str:
    """A chunked body sent until the server answers, at most twice the limit."""
    reader, writer = await _open(target)
    sent = 0

    async def send() -> None:
        nonlocal sent
        writer.write(_head(INFER_PATH, None))
        chunk = f"{CHUNK:x}\r\n".encode() + b" " * CHUNK + b"\r\n"
        while sent <= 2 * HTTP_MAX_INPUT:
            writer.write(chunk)
            await writer.drain()
            sent += CHUNK

    sending = asyncio.ensure_future(send())
    try:
        status = await _status(reader)
    except ConnectionError:
        # The server answered and closed with the rest of the body unread: its kernel resets
        # the connection, and the client's next write fails before it reads the answer.
        status = REFUSED
    except TimeoutError:
        status = "no answer"
    finally:
        sending.cancel()
        with contextlib.suppress(BaseException):
            await sending
        writer.close()
    result.notes["streamed_mib_before_refusal"] = max(
        result.notes.get("streamed_mib_before_refusal", 0.0), round(sent / (1 << 20), 1)
    )
    if sent > HTTP_MAX_INPUT + 8 * CHUNK:
        result.problems.append(f"{sent} bytes were taken before the refusal")
    if status == REFUSED and sent < HTTP_MAX_INPUT:
        result.problems.append(f"the connection was reset after {sent} bytes, within the limit")
    return f"streamed: {status}"


async def oversized_bodies(target: Target, scale: Scale) -> AttackResult:
    """`oversized_bodies` requests declaring a body one byte past --http-max-input-size (400
    before anything is read; they send none), at once; then as many chunked bodies streamed
    past it, one at a time (each may hold up to the limit while it arrives): 400 once the
    limit is passed, or the connection reset once the limit is passed (the server closes with
    the body unread, and the client's write may fail before it reads the 400)."""
    result = AttackResult()
    declared = await asyncio.gather(*(_declared(target) for _ in range(scale.oversized_bodies)))
    result.outcomes.update(declared)
    for _ in range(scale.oversized_bodies):
        result.outcomes[await _streamed(target, result)] += 1
    return result


async def _vanish(target: Target, kind: str) -> str:
    """One client that goes away: mid-request (half its body sent), before the answer (its
    request whole) or mid-answer (a long generation, after its first event)."""
    reader, writer = await _open(target)
    try:
        if kind == VANISHED[2]:
            prompt = {"text": "Once upon a time", "max_tokens": LONG_MAX_TOKENS}
            request = json.dumps(prompt).encode()
            writer.write(_head(STREAM_PATH, len(request)) + request)
            status = await _status(reader)
            if status != "200":
                return f"generate_stream: {status}"
            while b"data: " not in await asyncio.wait_for(reader.readline(), ANSWER_TIMEOUT_S):
                pass
        else:
            body = _body()
            sent = body[: len(body) // 2] if kind == VANISHED[0] else body
            writer.write(_head(INFER_PATH, len(body)) + sent)
            await writer.drain()
        return kind
    except (ConnectionError, TimeoutError) as exc:
        return f"{kind}: {type(exc).__name__}"
    finally:
        writer.transport.abort()


async def disconnect_storm(target: Target, scale: Scale) -> AttackResult:
    """`disconnects` clients of each kind, PARALLEL at once: afterwards no generation may be
    left running, and each vanished stream may have produced only a few tokens."""
    result = AttackResult()
    _, before = await _settled(target)
    gate = asyncio.Semaphore(PARALLEL)
    kinds = [kind for _ in range(scale.disconnects) for kind in VANISHED]
    result.outcomes.update(
        await asyncio.gather(*(_gated(gate, _vanish(target, kind)) for kind in kinds))
    )
    settled, after = await _settled(target)
    if not settled:
        result.problems.append("generations still active after every client vanished")
    per_stream = (after - before) / scale.disconnects
    result.notes["tokens_per_vanished_stream"] = round(per_stream, 1)
    # Gone after its first event, a generation stops within a few decode steps; one that ran
    # on would make about LONG_MAX_TOKENS.
    if per_stream > LONG_MAX_TOKENS / 2:
        result.problems.append(f"{per_stream:.0f} tokens per stream whose client vanished")
    return result
