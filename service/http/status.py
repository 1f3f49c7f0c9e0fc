"""A request's failure as an HTTP status, by Triton's mapping (`HttpCodeFromError`): what the
data plane raises carries a gRPC status code, and REST callers compare Triton's numbers."""

from __future__ import annotations

import grpc

from service.inference.errors import ServiceError

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
FORBIDDEN = 403  # Triton's answer to a restricted category's request without its header
# Seconds a client refused with 429 is told to wait before it tries again (Retry-After).
RETRY_AFTER_S = 1


def http_status(code: grpc.StatusCode) -> int:
    """INTERNAL 500, NOT_FOUND 404, UNAVAILABLE 503, UNIMPLEMENTED 501, RESOURCE_EXHAUSTED 429,
    everything else 400."""
    return _STATUS.get(code, BAD_REQUEST)


class Restricted(ServiceError):
    """A request of a restricted category without its header, found once its body is read
    (an infer request whose tensors name shared-memory regions): UNAUTHENTICATED, as gRPC
    answers it, and Triton's 403 over REST, where every other UNAUTHENTICATED is 400 (such as
    --sequence-callers certified's refusal: Triton maps codes it has no number for to 400)."""

    def __init__(self, missing: str, why: str) -> None:
        super().__init__(
            grpc.StatusCode.UNAUTHENTICATED,
            f"This API is restricted, expecting header '{missing}' ({why})",
        )


def error_status(error: ServiceError) -> int:
    """The status of a route's failure: 403 for a restricted request, else by its code."""
    return FORBIDDEN if isinstance(error, Restricted) else http_status(error.code)
