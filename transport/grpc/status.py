"""gRPC status codes on the wire: grpc-status/grpc-message, HTTP and HTTP/3 error mappings."""

from __future__ import annotations

import re

import grpc

# HTTP/3 error codes, RFC 9114 section 8.1.
H3_NO_ERROR = 0x100
H3_GENERAL_PROTOCOL_ERROR = 0x101
H3_INTERNAL_ERROR = 0x102
H3_STREAM_CREATION_ERROR = 0x103
H3_CLOSED_CRITICAL_STREAM = 0x104
H3_FRAME_UNEXPECTED = 0x105
H3_FRAME_ERROR = 0x106
H3_EXCESSIVE_LOAD = 0x107
H3_ID_ERROR = 0x108
H3_SETTINGS_ERROR = 0x109
H3_MISSING_SETTINGS = 0x10A
H3_REQUEST_REJECTED = 0x10B
H3_REQUEST_CANCELLED = 0x10C
H3_REQUEST_INCOMPLETE = 0x10D
H3_MESSAGE_ERROR = 0x10E
H3_CONNECT_ERROR = 0x10F
H3_VERSION_FALLBACK = 0x110

_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}
_STATUS_RE = re.compile(r"[0-9]{1,3}")
_PERCENT_RE = re.compile(rb"%([0-9A-Fa-f]{2})")

# PROTOCOL-HTTP2.md / http-grpc-status-mapping.md: only for responses without grpc-status.
_FROM_HTTP: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INTERNAL,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.UNIMPLEMENTED,
    429: grpc.StatusCode.UNAVAILABLE,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.UNAVAILABLE,
}

# gRFC G2 (gRPC over HTTP/3), "Errors": every code not listed maps to INTERNAL.
_FROM_H3: dict[int, grpc.StatusCode] = {
    H3_EXCESSIVE_LOAD: grpc.StatusCode.RESOURCE_EXHAUSTED,
    H3_REQUEST_REJECTED: grpc.StatusCode.UNAVAILABLE,
    H3_REQUEST_CANCELLED: grpc.StatusCode.CANCELLED,
}


def encode_grpc_message(text: str) -> str:
    """Percent-encode a status message: UTF-8 bytes outside 0x20-0x7E, and '%', become %XX.

    Lone surrogates (which UTF-8 cannot carry) become '?' rather than failing the call.
    """
    return "".join(
        chr(byte) if 0x20 <= byte <= 0x7E and byte != 0x25 else f"%{byte:02X}"
        for byte in text.encode("utf-8", "replace")
    )


def decode_grpc_message(value: str) -> str:
    """Undo encode_grpc_message leniently, as the spec demands: broken %-sequences are kept
    literally and invalid UTF-8 becomes U+FFFD; this never fails.

    `value` may hold raw bytes as surrogate escapes (bytes.decode("utf-8", "surrogateescape")),
    so peers that send unencoded UTF-8 are understood too.
    """
    try:
        raw = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # lone surrogates that are not escapes
        raw = value.encode("utf-8", "replace")
    unquoted = _PERCENT_RE.sub(lambda match: bytes([int(match.group(1), 16)]), raw)
    return unquoted.decode("utf-8", "replace")


def status_from_code(value: str) -> grpc.StatusCode:
    """The status in a grpc-status value; anything unrecognised is UNKNOWN."""
    if _STATUS_RE.fullmatch(value) is None:
        return grpc.StatusCode.UNKNOWN
    return _BY_NUMBER.get(int(value), grpc.StatusCode.UNKNOWN)


def code_number(status: grpc.StatusCode) -> int:
    """The wire number of a status code."""
    number: int = status.value[0]
    return number


def status_from_http(http_status: int) -> grpc.StatusCode:
    """Status for a response without grpc-status, from its HTTP status."""
    return _FROM_HTTP.get(http_status, grpc.StatusCode.UNKNOWN)


def status_from_h3_error(code: int) -> grpc.StatusCode:
    """Status for a stream the peer reset with an HTTP/3 error code."""
    return _FROM_H3.get(code, grpc.StatusCode.INTERNAL)
