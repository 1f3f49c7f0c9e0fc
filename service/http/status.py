"""A request's failure as an HTTP status, by Triton's mapping (`HttpCodeFromError`): what the
data plane raises carries a gRPC status code, and REST callers compare Triton's numbers."""

from __future__ import annotations

import grpc

_STATUS = {
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    # Not Triton's (it has no bounded queue to refuse from): a full queue is 429, as the
    # generate protocol and every REST serving framework say "overloaded".
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
}
BAD_REQUEST = 400
# Seconds a client refused with 429 is told to wait before it tries again (Retry-After).
RETRY_AFTER_S = 1


def http_status(code: grpc.StatusCode) -> int:
    """INTERNAL 500, NOT_FOUND 404, UNAVAILABLE 503, UNIMPLEMENTED 501, RESOURCE_EXHAUSTED 429,
    everything else 400."""
    return _STATUS.get(code, BAD_REQUEST)
