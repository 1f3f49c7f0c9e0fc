"""The one exception the wire layer raises for malformed peer input."""

from __future__ import annotations

import grpc


class ProtocolError(Exception):
    """A peer violated the gRPC wire protocol.

    `status` is what the call fails with; `http_status` is set only when the request is so
    malformed that it must be answered with a non-200 HTTP status instead of gRPC trailers.
    """

    def __init__(
        self, status: grpc.StatusCode, message: str, http_status: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.http_status = http_status
