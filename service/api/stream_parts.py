"""The messages of a stream's part: the requests of a ModelStreamInfer stream that a front-end
passed on to the parent, in one stream of their own (service/frontends/stream_here.py). Each
response comes with a flag byte ahead of it: whether it is its request's last (so the front-end
knows which requests are in flight, for the stall bound's count), and whether there is a
response at all (a request may end with nothing to send)."""

from __future__ import annotations

from protos.inference import grpc_service_pb2 as pb

LAST = 1
NOTHING = 2  # the request ended with nothing to send


class BadPart(ValueError):
    """A part message no parent sends."""


def encode(item: tuple[pb.ModelStreamInferResponse | None, bool]) -> bytes:
    response, last = item
    flags = (LAST if last else 0) | (NOTHING if response is None else 0)
    return bytes((flags,)) + (b"" if response is None else response.SerializeToString())


def decode(message: bytes) -> tuple[bytes | None, bool]:
    """The response's bytes (None: nothing to send) and whether it is its request's last."""
    if not message or message[0] & ~(LAST | NOTHING):
        raise BadPart(f"a stream part's message with flags {message[:1]!r}")
    flags = message[0]
    if flags & NOTHING:
        if len(message) > 1:
            raise BadPart("a stream part's message says it has nothing, and has bytes")
        return None, bool(flags & LAST)
    return message[1:], bool(flags & LAST)
