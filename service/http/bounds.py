"""A REST request's bounds, per request: its header block's size, its body's size and the time
all of it may take, its Content-Encoding decoded within the body's size. What passes one is
`Refused`, answered with its HTTP status before the request's route runs."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from service.http.asgi import Receive, Scope, header
from service.http.encoding import EncodingError, inflated


@dataclass(frozen=True)
class RequestLimits:
    max_header_bytes: int  # a request's header block, RFC 9114 size (--max-metadata-bytes)
    max_body_bytes: int  # per request (--http-max-input-size)
    body_timeout_s: float  # for all of one request's body (--http-body-timeout)
    max_requests: int  # handled at once, every connection together (--max-concurrent-rpcs)
    stall_s: float  # a stream's client may take no event this long (--stream-stall-timeout)


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


async def read_body(scope: Scope, receive: Receive, limits: RequestLimits) -> bytes:
    """The request's body, at most `max_bytes` (a larger Content-Length is refused before
    anything is read, a longer chunked body as soon as it passes the limit), all of it within
    `timeout_s`."""
    declared = _content_length(scope)
    if declared is not None and declared > limits.max_body_bytes:
        raise Refused(
            400,
            f"the request body has {declared} bytes, more than --http-max-input-size "
            f"{limits.max_body_bytes}; refused before reading it",
            close=True,
            code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
    body = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise Refused(
                        400,
                        "the client went away before its body ended",
                        close=True,
                        code=grpc.StatusCode.CANCELLED,
                    )
                body += message.get("body", b"")
                if len(body) > limits.max_body_bytes:
                    raise Refused(
                        400,
                        f"the request body has more than --http-max-input-size "
                        f"{limits.max_body_bytes} bytes",
                        close=True,
                        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                    )
                if not message.get("more_body", False):
                    return bytes(body)
    except TimeoutError:
        raise Refused(
            408,
            f"the request body took more than --http-body-timeout {limits.body_timeout_s:g} s "
            f"({len(body)} bytes arrived)",
            close=True,
            code=grpc.StatusCode.DEADLINE_EXCEEDED,
        ) from None


async def decoded(scope: Scope, body: bytes, limit: int) -> bytes:
    """The body before its Content-Encoding (Triton's: gzip, deflate), within `limit`."""
    encoding = header(scope, b"content-encoding")
    if encoding is None:
        return body
    try:
        return await inflated(body, encoding, limit)
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
