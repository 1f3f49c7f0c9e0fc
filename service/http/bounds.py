"""A REST request's bounds, per request: its header block's size, its body's size and the time
all of it may take, its Content-Encoding decoded within the body's size. What passes one is
`Refused`, answered with its HTTP status before the request's route runs."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from service.http.asgi import Receive, Scope, header
from service.http.body_budget import JSON_HOLD_FACTOR, BodyCharge, held_for
from service.http.encoding import EncodingError, inflated

# Triton's binary tensor data extension: where a body's JSON ends and its binary data begins.
HEADER_LENGTH = b"inference-header-content-length"


@dataclass(frozen=True)
class RequestLimits:
    max_header_bytes: int  # a request's header block, RFC 9114 size (--max-metadata-bytes)
    max_body_bytes: int  # per request (--http-max-input-size)
    body_timeout_s: float  # for all of one request's body (--http-body-timeout)
    max_requests: int  # handled at once, every connection together (--max-concurrent-rpcs)
    stall_s: float  # a stream's client may take no event this long (--stream-stall-timeout)
    receive_budget: int  # what bodies may hold in this process (--http-receive-budget)
    receive_budget_per_address: int  # of one client address (--http-receive-budget-per-address)


class Refused(Exception):
    """A request answered before its route runs (its body too large or too slow, an unknown
    path); `close`: its connection cannot carry another request (a body left unread); `code`:
    what metrics and the request log count it as, in gRPC's terms as every other call."""

    def __init__(
        self,
        status: int,
        message: str,
        close: bool = False,
        code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close
        self.code = code


async def read_body(
    scope: Scope,
    receive: Receive,
    limits: RequestLimits,
    charge: BodyCharge,
    binary: bool = False,
) -> bytes:
    """The request's body, at most `max_bytes` (a larger Content-Length is refused before
    anything is read, a longer chunked body as soon as it passes the limit), all of it within
    `timeout_s`, charged to the process's body budget as it comes (body_budget.py; a declared
    length whole before it is read). `binary`: the route reads Triton's binary tensor data
    after the JSON its Inference-Header-Content-Length measures."""
    declared = _content_length(scope)
    if declared is not None and declared > limits.max_body_bytes:
        raise Refused(
            400,
            f"the request body has {declared} bytes, more than --http-max-input-size "
            f"{limits.max_body_bytes}; refused before reading it",
            close=True,
            code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
    json_bytes = _json_length(scope, binary)
    body = bytearray()
    waiting = False
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            if declared:
                whole = held_for(declared, json_bytes)
                _check_fits(charge, whole, declared)
                waiting = True
                await charge.wait_for(whole)
                waiting = False
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise Refused(
                        400,
                        "the client went away before its body ended",
                        close=True,
                        code=grpc.StatusCode.CANCELLED,
                    )
                chunk = message.get("body", b"")
                if len(body) + len(chunk) > limits.max_body_bytes:
                    raise Refused(
                        400,
                        f"the request body has more than --http-max-input-size "
                        f"{limits.max_body_bytes} bytes",
                        close=True,
                        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                    )
                take(charge, held_for(len(body) + len(chunk), json_bytes) - charge.held)
                body += chunk
                if not message.get("more_body", False):
                    return bytes(body)
    except TimeoutError:
        if waiting:
            raise Refused(
                429,
                f"no room in this process's REST receive budget for a body of {declared} "
                f"bytes within --http-body-timeout {limits.body_timeout_s:g} s "
                f"({_budget_words(charge)}); try again",
                close=True,
                code=grpc.StatusCode.RESOURCE_EXHAUSTED,
            ) from None
        raise Refused(
            408,
            f"the request body took more than --http-body-timeout {limits.body_timeout_s:g} s "
            f"({len(body)} bytes arrived)",
            close=True,
            code=grpc.StatusCode.DEADLINE_EXCEEDED,
        ) from None


def take(charge: BodyCharge, size: int) -> None:
    """`size` more of the budget for a request already holding some, or its refusal (never a
    wait: body_budget.py)."""
    if charge.take(size):
        return
    _check_fits(charge, size, None)
    raise Refused(
        429,
        f"no room in this process's REST receive budget for the rest of the request "
        f"({_budget_words(charge)}); try again",
        close=True,
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
    )


# A response body is sent in pieces of at most this, each within --http-send-timeout
# (listener.py).
SEND_PIECE = 1 << 20


def answer_held(size: int) -> int:
    """What an answer of `size` bytes holds while it is sent: its bytes, and the copies of a
    piece the HTTP connection makes (its framing, then the socket's buffer)."""
    return size + 2 * min(size, SEND_PIECE)


def hold_answer(charge: BodyCharge, size: int) -> None:
    """An answer of `size` bytes held against the budget until its client has taken it (its
    request's body given back by then), or its refusal: 429 when the answers and bodies of the
    address (or of all) hold the budget now, 400 for one that could never fit."""
    held = answer_held(size)
    if charge.take(held):
        return
    if not charge.could_fit(held):
        raise Refused(
            400,
            f"the answer would hold {held} bytes until its client has read it, more than this "
            f"process's REST budget ({_budget_words(charge)}): ask for the outputs as binary "
            "data (binary_data_output) or raise the budget",
            code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
    raise Refused(
        429,
        f"no room in this process's REST budget for an answer of {size} bytes: answers its "
        f"clients have not read yet and bodies being read hold it ({_budget_words(charge)}); "
        "read the answers, then try again",
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
    )


def _check_fits(charge: BodyCharge, size: int, declared: int | None) -> None:
    """413 for a request that could never be granted what it needs."""
    if charge.could_fit(size):
        return
    what = f"a body of {declared} bytes" if declared is not None else "this body"
    raise Refused(
        413,
        f"{what} would hold {charge.held + size} bytes while it is read and parsed (JSON: "
        f"{JSON_HOLD_FACTOR} times its bytes), more than this process's REST receive budget "
        f"({_budget_words(charge)}): send tensors as binary data (Triton's binary tensor data "
        "extension) or raise the budget",
        close=True,
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
    )


def _budget_words(charge: BodyCharge) -> str:
    return (
        f"--http-receive-budget-per-address {charge.per_address}, "
        f"--http-receive-budget {charge.total}"
    )


def _json_length(scope: Scope, binary: bool) -> int | None:
    """How many of the body's first bytes are JSON (None: all of them): none of a compressed
    body (charged again once inflated: decoded), else all but the binary data of a route that
    reads it (`binary`)."""
    encoding = header(scope, b"content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        return 0
    return _header_length(scope) if binary else None


def _header_length(scope: Scope) -> int | None:
    """The JSON's bytes before the binary data (Inference-Header-Content-Length), None: the
    whole body's."""
    value = header(scope, HEADER_LENGTH)
    try:
        return None if value is None else max(int(value), 0)
    except ValueError:
        return None


async def decoded(scope: Scope, body: bytes, limit: int, charge: BodyCharge) -> bytes:
    """The body before its Content-Encoding (Triton's: gzip, deflate), within `limit`, what it
    inflates to charged before it is built (its JSON as any JSON body: binary data after the
    JSON its Inference-Header-Content-Length measures)."""
    encoding = header(scope, b"content-encoding")
    if encoding is None:
        return body
    json_bytes = _header_length(scope)
    try:
        return await inflated(
            body, encoding, limit, lambda size: take(charge, held_for(size, json_bytes))
        )
    except EncodingError as exc:
        if exc.unsupported:
            raise Refused(501, str(exc), code=grpc.StatusCode.UNIMPLEMENTED) from None
        raise Refused(400, str(exc)) from None


def check_headers(scope: Scope, limit: int) -> None:
    """The server library bounds a header block while it is incomplete (h11) or by the size
    it advertised (h2); one that arrived whole in a single read is measured here."""
    size = sum(len(name) + len(value) + 32 for name, value in scope["headers"])
    if size > limit:
        raise Refused(
            431,
            f"the request's headers have {size} bytes, more than {limit}",
            close=True,
            code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        )


def _content_length(scope: Scope) -> int | None:
    value = header(scope, b"content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise Refused(400, "Content-Length is not a number", close=True) from None
