"""Attacks on the REST port, over raw HTTP/1.1 connections from another loopback address than
the good clients': slow clients that trickle their headers or their body a byte at a time,
bodies past --http-max-input-size (declared, and streamed in chunks), bodies that hold the
address's receive budget (stalled, JSON too large to parse, chunked past it), answers never read,
and storms of clients
that send an infer or a generate_stream request and vanish mid-request, before the answer or
mid-answer. Each checks that the server cut the attacker off within its bound and, for the
storms, that the generations of vanished clients stopped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import struct
import time
from collections.abc import Awaitable

import h2.config
import h2.connection
import h2.errors
import h2.events

from tests.chaos.floods import ATTACKER_HOST
from tests.chaos.generations import LONG_MAX_TOKENS, _settled
from tests.chaos.harness import (
    ECHO_MODEL,
    GENERATION_MODEL,
    GOOD_MODEL,
    HTTP_BODY_S,
    HTTP_KEEPALIVE_S,
    HTTP_MAX_INPUT,
    HTTP_RECEIVE_BUDGET_PER_ADDRESS,
    HTTP_SEND_S,
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
# Triton's binary tensor data after no JSON: a body the receive budget charges twice its bytes.
BINARY_DATA = "Inference-Header-Content-Length: 0\r\n"
# What a streamed body may have sent past the limit before its answer came: the loopback socket
# buffers (the client's send buffer, the server's autotuned receive buffer) and, with
# --frontends, the hop from a front-end to the parent (its queue, the call's window, the link).
# Measured: up to 6 MiB in one process, 9 MiB with --frontends 2; a server that read the whole
# body before refusing it would show the limit's 16 MiB.
BUFFERED = 12 << 20
PARALLEL = 16  # attacking connections at once
ANSWER_TIMEOUT_S = 30.0
# Outcomes
HELD = frozenset({"stalled: 408", "stalled: 429", "json: 413", "chunked: 429", "chunked: 413"})
HEADERS_CUT = "headers: connection closed"
BODY_408 = "body: 408"
DECLARED_400 = "declared: 400"
STREAMED_400 = "streamed: 400"
VANISHED = ("vanished mid-request", "vanished before the answer", "vanished mid-answer")
RESET = "HTTP/2 stream reset mid-answer"


def _body() -> bytes:
    tensor = {"name": "input", "datatype": "FP32", "shape": [1, 256], "data": [0.5] * 256}
    return json.dumps({"inputs": [tensor]}).encode()


def _head(path: str, length: int | None, extra: str = "") -> bytes:
    """`extra`: more header lines, each ending in CRLF."""
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
    """A chunked body sent until the server answers, at most twice the limit. The server
    drops what comes after its answer (a lingering close), so the sender yields after each
    chunk: what it sent counts what the server took before answering, and the socket buffers,
    not what it went on sending before it read the answer."""
    reader, writer = await _open(target)
    sent = 0

    async def send() -> None:
        nonlocal sent
        # Binary data after no JSON: a JSON body would find the receive budget first (below).
        writer.write(_head(INFER_PATH, None, BINARY_DATA))
        chunk = f"{CHUNK:x}\r\n".encode() + b" " * CHUNK + b"\r\n"
        while sent <= 2 * HTTP_MAX_INPUT:
            writer.write(chunk)
            await writer.drain()
            sent += CHUNK
            await asyncio.sleep(0)  # drain does not yield while the server keeps reading

    sending = asyncio.ensure_future(send())
    try:
        status = await _status(reader)
    except ConnectionError:
        # The server closed with the rest of the body unread, without the lingering close
        # that lets a client still writing read its answer.
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
    if sent > HTTP_MAX_INPUT + BUFFERED:
        result.problems.append(f"{sent} bytes were taken before the refusal")
    return f"streamed: {status}"


async def _held(target: Target, length: int, extra: str, sent_bytes: int) -> str:
    """A body of `length` declared, `sent_bytes` of it sent (in pieces, a declared body the
    server has not taken waits in the socket), then the answer."""
    reader, writer = await _open(target)
    try:
        writer.write(_head(INFER_PATH, length, extra))
        piece = bytes(CHUNK)
        for start in range(0, sent_bytes, CHUNK):
            writer.write(piece[: min(CHUNK, sent_bytes - start)])
            await writer.drain()
        return await _status(reader)
    except ConnectionError:
        return "connection closed"
    finally:
        writer.close()


async def _chunked_json(target: Target) -> str:
    """A chunked JSON body's chunks until the server answers (it finds no room first)."""
    reader, writer = await _open(target)

    async def send() -> None:
        writer.write(_head(INFER_PATH, None))
        chunk = f"{CHUNK:x}\r\n".encode() + b" " * CHUNK + b"\r\n"
        for _ in range(HTTP_MAX_INPUT // CHUNK):
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0)

    sending = asyncio.ensure_future(send())
    try:
        return await _status(reader)
    except ConnectionError:
        return REFUSED
    finally:
        sending.cancel()
        with contextlib.suppress(BaseException):
            await sending
        writer.close()


async def held_bodies(target: Target, scale: Scale) -> AttackResult:
    """`held_bodies` connections of one address declare binary bodies of an eighth of its
    receive budget's charge and send all but a byte, at once: a few are read, the rest wait
    unread, and each ends at the body timeout (408, or 429 for one that never found room).
    Meanwhile as many JSON bodies whose parse would hold more than the address may are refused
    413 unread, and chunked JSON bodies 429 (or 413) at the chunk that finds no room."""
    result = AttackResult()
    size = HTTP_RECEIVE_BUDGET_PER_ADDRESS // 8 // 2
    stalled = [_held(target, size, BINARY_DATA, size - 1) for _ in range(scale.held_bodies)]
    too_large = HTTP_RECEIVE_BUDGET_PER_ADDRESS // 40  # times the 48 a JSON byte is charged
    json = [_held(target, too_large, "", 0) for _ in range(scale.held_bodies // 4)]
    chunked = [_chunked_json(target) for _ in range(scale.held_bodies // 4)]
    outcomes = await asyncio.gather(*stalled, *json, *chunked)
    kinds = ["stalled"] * len(stalled) + ["json"] * len(json) + ["chunked"] * len(chunked)
    result.outcomes.update(
        f"{kind}: {outcome}" for kind, outcome in zip(kinds, outcomes, strict=True)
    )
    return result


UNREAD_RESET = "unread: 200, reset"
UNREAD_429 = "unread: 429"
UNREAD = frozenset({UNREAD_RESET, UNREAD_429})
# NUL bytes: an answer of 9 MiB of JSON, more than the sockets buffer (tcp_wmem's default most,
# 4 MiB), and a request below a quarter of the instance queue (--instance-queue-mb 8).
ECHO_ELEMENT = 3 << 19
# A client reading nothing is reset HTTP_SEND_S after its answer stalls; one refused 429 is
# closed at the keep-alive timeout: each far within this on a loaded machine too.
RESET_WITHIN_S = 60.0


def _echo_request() -> bytes:
    """An infer request of ECHO_MODEL, its one element ECHO_ELEMENT NUL bytes as binary data."""
    element = struct.pack("<I", ECHO_ELEMENT) + bytes(ECHO_ELEMENT)
    tensor = {"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1]}
    document = json.dumps(
        {"inputs": [{**tensor, "parameters": {"binary_data_size": len(element)}}]}
    ).encode()
    extra = f"Inference-Header-Content-Length: {len(document)}\r\n"
    return _head(f"/v2/models/{ECHO_MODEL}/infer", len(document) + len(element), extra) + (
        document + element
    )


def _unread(port: int, message: bytes) -> tuple[str, str]:
    """One client that sends its request and reads nothing until the server ends the
    connection (a thread's blocking socket: its receive buffer kept small), then what came."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.bind((ATTACKER_HOST, 0))
        sock.connect(("127.0.0.1", port))
        sock.sendall(message)
        poller = select.poll()
        poller.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        if not poller.poll(int(RESET_WITHIN_S * 1000)):
            return "never closed", f"not closed within {RESET_WITHIN_S} s"
        sock.settimeout(5)
        with contextlib.suppress(OSError):
            line = sock.recv(64).split(b"\r\n", 1)[0].split()
            if line[1:2] == [b"200"]:
                return UNREAD_RESET, ""
            if line[1:2] == [b"429"]:
                return UNREAD_429, ""
        return "no answer", ""
    finally:
        sock.close()


async def unread_answers(target: Target, scale: Scale) -> AttackResult:
    """`unread_answers` connections of one address ask `simple_identity` for an answer of 9
    MiB (charged with the copies its sending makes) and read nothing, at once: the answers the
    address's budget holds wait for their clients, the others are refused 429, and each
    connection is closed, a held one reset once --http-send-timeout passes without a byte
    taken (the row's RSS goal bounds what they held meanwhile)."""
    result = AttackResult()
    message = _echo_request()
    outcomes = await asyncio.gather(
        *(
            asyncio.to_thread(_unread, target.http_port, message)
            for _ in range(scale.unread_answers)
        )
    )
    for outcome, problem in outcomes:
        result.outcomes[outcome] += 1
        if problem:
            result.problems.append(problem)
    result.notes["send timeout s"] = HTTP_SEND_S
    return result


async def oversized_bodies(target: Target, scale: Scale) -> AttackResult:
    """`oversized_bodies` requests declaring a body one byte past --http-max-input-size (400
    before anything is read; they send none), at once; then as many chunked bodies streamed
    past it, one at a time (each may hold up to the limit while it arrives): 400 once the
    limit is passed, which the client reads while it is still sending (the server lingers,
    dropping what it sends, rather than resetting the connection)."""
    result = AttackResult()
    declared = await asyncio.gather(*(_declared(target) for _ in range(scale.oversized_bodies)))
    result.outcomes.update(declared)
    for _ in range(scale.oversized_bodies):
        result.outcomes[await _streamed(target, result)] += 1
    return result


def _generation() -> bytes:
    return json.dumps({"text": "Once upon a time", "max_tokens": LONG_MAX_TOKENS}).encode()


async def _vanish(target: Target, kind: str) -> str:
    """One client that goes away: mid-request (half its body sent), before the answer (its
    request whole) or mid-answer (a long generation, after its first event)."""
    reader, writer = await _open(target)
    try:
        if kind == VANISHED[2]:
            request = _generation()
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


async def _resets(target: Target, count: int) -> list[str]:
    """`count` generate_stream requests on one HTTP/2 connection (h2c, prior knowledge), each
    stream reset (RST_STREAM, CANCEL) once its first event came; the connection then closed."""
    reader, writer = await _open(target)
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    request = _generation()
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":authority", "chaos"),
        (":path", STREAM_PATH),
        ("content-type", "application/json"),
        ("content-length", str(len(request))),
    ]
    pending = set()
    for _ in range(count):
        stream = connection.get_next_available_stream_id()
        connection.send_headers(stream, headers)
        connection.send_data(stream, request, end_stream=True)
        pending.add(stream)
    outcomes: list[str] = []
    try:
        while pending:
            writer.write(connection.data_to_send())
            await writer.drain()
            data = await asyncio.wait_for(reader.read(1 << 16), ANSWER_TIMEOUT_S)
            if not data:
                break
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    length = event.flow_controlled_length or 0
                    connection.acknowledge_received_data(length, event.stream_id)
                if getattr(event, "stream_id", None) not in pending:  # settings, pings
                    continue
                if isinstance(event, h2.events.ResponseReceived):
                    status = dict(event.headers or [])[b":status"].decode()
                    if status != "200":
                        outcomes.append(f"HTTP/2 generate_stream: {status}")
                        pending.discard(event.stream_id)
                elif isinstance(event, h2.events.DataReceived) and b"data: " in event.data:
                    connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.CANCEL)
                    outcomes.append(RESET)
                    pending.discard(event.stream_id)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    outcomes.append("HTTP/2 stream ended before its reset")
                    pending.discard(event.stream_id)
        writer.write(connection.data_to_send())
        await writer.drain()
    except (ConnectionError, TimeoutError) as exc:
        outcomes.append(f"HTTP/2: {type(exc).__name__}")
    finally:
        writer.transport.abort()
    return outcomes + ["HTTP/2 connection closed"] * (count - len(outcomes))


async def disconnect_storm(target: Target, scale: Scale) -> AttackResult:
    """`disconnects` clients of each kind over HTTP/1.1, PARALLEL at once, then `disconnects`
    HTTP/2 streams reset mid-answer, PARALLEL on each connection: after each, no generation
    may be left running, and each vanished stream may have produced only a few tokens."""
    result = AttackResult()
    gate = asyncio.Semaphore(PARALLEL)
    kinds = [kind for _ in range(scale.disconnects) for kind in VANISHED]

    async def http1() -> None:
        calls = (_gated(gate, _vanish(target, kind)) for kind in kinds)
        result.outcomes.update(await asyncio.gather(*calls))

    async def http2() -> None:
        for first in range(0, scale.disconnects, PARALLEL):
            count = min(PARALLEL, scale.disconnects - first)
            result.outcomes.update(await _resets(target, count))

    for name, storm in (("http1", http1), ("http2", http2)):
        _, before = await _settled(target)
        await storm()
        settled, after = await _settled(target)
        if not settled:
            result.problems.append(f"{name}: generations still active after their clients left")
        per_stream = (after - before) / scale.disconnects
        result.notes[f"tokens_per_vanished_stream_{name}"] = round(per_stream, 1)
        # Gone after its first event, a generation stops within a few decode steps; one that
        # ran on would make about LONG_MAX_TOKENS.
        if per_stream > LONG_MAX_TOKENS / 2:
            result.problems.append(f"{name}: {per_stream:.0f} tokens per vanished stream")
    return result
