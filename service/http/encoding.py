"""Compressed REST bodies, as Triton serves them on `/infer`: a request's `Content-Encoding`
(gzip or deflate) inflated within the body limit, and the response compressed as the client's
`Accept-Encoding` prefers (q-values; identity unless it asks)."""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import Callable

from transport.grpc.errors import ProtocolError
from transport.grpc.framing import IDENTITY, decompress, inflated_size

ENCODINGS = ("gzip", "deflate")  # deflate is zlib's format, as tritonclient and Triton send it
INLINE_BYTES = 1 << 20  # bodies larger than this are (in|de)flated in a thread (zlib lets go
# of the GIL while it works, so the event loop goes on meanwhile)


class EncodingError(ValueError):
    """A body that cannot be inflated; `unsupported`: its encoding is not one served."""

    def __init__(self, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.unsupported = unsupported


async def inflated(body: bytes, encoding: str, limit: int, admit: Callable[[int], None]) -> bytes:
    """The body as sent before its `Content-Encoding`, at most `limit` bytes (a body that would
    inflate past it is refused once its output passes the limit, never built whole). `admit`
    hears the inflated size before the body is built, and may refuse it by raising."""
    encoding = encoding.strip().lower()
    if encoding in ("", IDENTITY):
        return body
    if encoding not in ENCODINGS:
        raise EncodingError(
            f"Content-Encoding {encoding[:32]!r} is not served; send gzip, deflate or identity",
            unsupported=True,
        )
    try:
        if len(body) <= INLINE_BYTES:
            admit(inflated_size(body, encoding, limit))
            return decompress(body, encoding)
        admit(await asyncio.to_thread(inflated_size, body, encoding, limit))
        return await asyncio.to_thread(decompress, body, encoding)
    except ProtocolError as exc:
        raise EncodingError(f"{exc.message} (--http-max-input-size)") from None


def preferred(accept_encoding: str | None) -> str | None:
    """The encoding a response takes: of gzip and deflate, the one `Accept-Encoding` gives the
    highest q-value above 0 (`*` stands for any not named; gzip on a tie); None: identity."""
    if not accept_encoding:
        return None
    weights: dict[str, float] = {}
    for entry in accept_encoding.split(",")[:32]:
        coding, _, parameters = entry.partition(";")
        q = 1.0
        name, _, value = parameters.strip().partition("=")
        if name.strip().lower() == "q":
            try:
                q = float(value)
            except ValueError:
                q = 0.0
        weights[coding.strip().lower()] = q
    wildcard = weights.get("*", 0.0)
    best = max(ENCODINGS, key=lambda e: (weights.get(e, wildcard), e == "gzip"))
    return best if weights.get(best, wildcard) > 0 else None


async def deflated(body: bytes, encoding: str) -> bytes:
    compress = gzip.compress if encoding == "gzip" else zlib.compress
    if len(body) <= INLINE_BYTES:
        return compress(body)
    return await asyncio.to_thread(compress, body)
