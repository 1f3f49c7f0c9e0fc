"""gRPC request, response and trailer header blocks as aioquic's H3 layer carries them.

Header blocks are lists of (name, value) byte pairs. Builders take trusted local input and
raise ValueError on misuse; parsers take peer input and raise only ProtocolError.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from transport.grpc.errors import ProtocolError
from transport.grpc.framing import ACCEPT_ENCODING, ACCEPTED_ENCODINGS, IDENTITY
from transport.grpc.metadata import Metadata, decode_metadata, encode_metadata
from transport.grpc.status import (
    code_number,
    decode_grpc_message,
    encode_grpc_message,
    status_from_code,
    status_from_http,
)
from transport.grpc.timeout import format_timeout, parse_timeout

Headers = list[tuple[bytes, bytes]]

_CONTENT_TYPE = b"application/grpc"
_REQUEST_PSEUDO = (b":method", b":scheme", b":path", b":authority")
_PATH_RE = re.compile(r"/[^/]+/[^/]+")
_HTTP_STATUS_RE = re.compile(rb"[1-5][0-9][0-9]")


def field_section_size(headers: Headers) -> int:
    """A header block's size as HTTP/3 limits it (RFC 9114 section 4.2.2): name and value
    lengths plus 32 per field."""
    return sum(len(name) + len(value) + 32 for name, value in headers)


@dataclass(frozen=True)
class RequestHead:
    """What a server needs from request headers to dispatch a call."""

    method_path: str
    authority: str
    timeout: float | None
    metadata: Metadata


@dataclass(frozen=True)
class ResponseHead:
    """Response headers of a call that goes on to send messages."""

    metadata: Metadata


@dataclass(frozen=True)
class Status:
    """The outcome of a call, from trailers or synthesized from a broken response."""

    code: grpc.StatusCode
    message: str = ""
    metadata: Metadata = ()


def request_headers(
    authority: str,
    path: str,
    timeout: float | None,
    metadata: Iterable[tuple[str, str | bytes]] = (),
    user_agent: str = "paddlequic-h3",
) -> Headers:
    """Request headers in the order the spec recommends (timeout right after pseudo-headers).

    A "user-agent" in `metadata` is put in front of ours, as gRPC runtimes do, rather than
    sent twice.
    """
    fields = encode_metadata(metadata)
    agents = [value for name, value in fields if name == b"user-agent"]
    agents.append(user_agent.encode("ascii"))
    headers: Headers = [
        (b":method", b"POST"),
        (b":scheme", b"https"),
        (b":path", path.encode("ascii")),
        (b":authority", authority.encode("ascii")),
        (b"te", b"trailers"),
    ]
    if timeout is not None:
        headers.append((b"grpc-timeout", format_timeout(timeout).encode("ascii")))
    headers += [(b"content-type", _CONTENT_TYPE), (b"user-agent", b" ".join(agents))]
    return headers + [(name, value) for name, value in fields if name != b"user-agent"]


def parse_request_headers(headers: Iterable[tuple[bytes, bytes]]) -> RequestHead:
    """Validate request headers and extract the call's parameters.

    Malformed requests get 400, non-POST 405 and non-gRPC content types 415, as HTTP answers.
    A missing "te: trailers" is tolerated: it only exists to detect broken proxies, and some
    clients omit it.
    """
    headers = list(headers)
    pseudo: dict[bytes, str] = {}
    for name, value in headers:
        if not name.startswith(b":"):
            continue
        if name not in _REQUEST_PSEUDO or name in pseudo:
            raise ProtocolError(
                grpc.StatusCode.INTERNAL,
                f"unexpected or repeated pseudo-header {name.decode('latin-1')}",
                http_status=400,
            )
        pseudo[name] = value.decode("latin-1")
    for required in _REQUEST_PSEUDO:
        if required not in pseudo:
            raise ProtocolError(
                grpc.StatusCode.INTERNAL,
                f"request without {required.decode('ascii')}",
                http_status=400,
            )
    if pseudo[b":method"] != "POST":
        raise ProtocolError(
            grpc.StatusCode.INTERNAL,
            f"method {pseudo[b':method']!r} is not allowed: gRPC uses POST",
            http_status=405,
        )
    content_type = _field(headers, b"content-type")
    if content_type is None or not _is_grpc_content_type(content_type):
        raise ProtocolError(
            grpc.StatusCode.INTERNAL,
            f"content-type {content_type!r} is not application/grpc",
            http_status=415,
        )
    encoding = message_encoding(headers)
    if encoding not in ACCEPTED_ENCODINGS:
        raise ProtocolError(
            grpc.StatusCode.UNIMPLEMENTED,
            f"grpc-encoding {encoding!r} is not supported (accepted: {ACCEPT_ENCODING})",
        )
    path = pseudo[b":path"]
    if _PATH_RE.fullmatch(path) is None:
        raise ProtocolError(grpc.StatusCode.UNIMPLEMENTED, f"malformed method path {path!r}")
    timeout = _field(headers, b"grpc-timeout")
    return RequestHead(
        method_path=path,
        authority=pseudo[b":authority"],
        timeout=None if timeout is None else parse_timeout(timeout),
        metadata=decode_metadata(headers),
    )


def message_encoding(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The grpc-encoding of a header block's messages, lowercase (identity when absent)."""
    value = _field(list(headers), b"grpc-encoding")
    return IDENTITY if value is None else value.strip().lower()


def carries_grpc(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a header block opens a gRPC exchange rather than plain HTTP (REST): a request
    whose content-type is gRPC's, a response whose content-type is gRPC's or absent (an
    error answered at the HTTP level has none)."""
    headers = list(headers)
    content_type = _field(headers, b"content-type")
    if content_type is None:
        return not any(name == b":method" for name, _ in headers)
    return _is_grpc_content_type(content_type)


def request_path(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The :path of request headers, whatever else is wrong with them ("" without one)."""
    return next((v.decode("latin-1") for k, v in headers if k == b":path"), "")


def response_headers(metadata: Iterable[tuple[str, str | bytes]] = ()) -> Headers:
    """Response headers that open a normal (messages then trailers) response. Responses are
    not compressed; grpc-accept-encoding tells a client what it may send, as grpcio does."""
    return [
        (b":status", b"200"),
        (b"content-type", _CONTENT_TYPE),
        (b"grpc-accept-encoding", ACCEPT_ENCODING.encode("ascii")),
        *encode_metadata(metadata),
    ]


def trailers(
    status: grpc.StatusCode,
    message: str = "",
    metadata: Iterable[tuple[str, str | bytes]] = (),
) -> Headers:
    """Trailers that end a response; sent even for OK."""
    headers: Headers = [(b"grpc-status", str(code_number(status)).encode("ascii"))]
    if message:
        headers.append((b"grpc-message", encode_grpc_message(message).encode("ascii")))
    return headers + encode_metadata(metadata)


def trailers_only(
    status: grpc.StatusCode,
    message: str = "",
    metadata: Iterable[tuple[str, str | bytes]] = (),
) -> Headers:
    """One header block that is the whole response, for calls that fail before any message."""
    return response_headers() + trailers(status, message, metadata)


def error_response(http_status: int) -> Headers:
    """Headers for a request that must be refused at the HTTP level (400, 405, 415, ...)."""
    return [(b":status", str(http_status).encode("ascii"))]


def is_trailers_only(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a response header block already carries the call's status."""
    return any(name == b"grpc-status" for name, _ in headers)


def parse_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> ResponseHead | Status:
    """ResponseHead when messages follow; otherwise the call's final Status.

    A grpc-status in the block (Trailers-Only) always wins. Without one, a non-200 HTTP status
    maps per the spec's table and a non-gRPC content type gives UNKNOWN: the response came from
    something that is not a gRPC server.
    """
    headers = list(headers)
    if is_trailers_only(headers):
        return parse_trailers(headers)
    http_status = next((value for name, value in headers if name == b":status"), None)
    if http_status is None or _HTTP_STATUS_RE.fullmatch(http_status) is None:
        return Status(grpc.StatusCode.INTERNAL, f"response with invalid :status {http_status!r}")
    if http_status != b"200":
        code = int(http_status)
        return Status(status_from_http(code), f"received HTTP status {code} without grpc-status")
    content_type = _field(headers, b"content-type")
    if content_type is None or not _is_grpc_content_type(content_type):
        return Status(grpc.StatusCode.UNKNOWN, f"unexpected response content-type {content_type!r}")
    return ResponseHead(metadata=decode_metadata(headers))


def parse_trailers(headers: Iterable[tuple[bytes, bytes]]) -> Status:
    """The call's Status from trailers (or a Trailers-Only block)."""
    headers = list(headers)
    value = _field(headers, b"grpc-status")
    if value is None:
        return Status(grpc.StatusCode.INTERNAL, "missing grpc-status")
    message = next((raw for name, raw in headers if name == b"grpc-message"), b"")
    return Status(
        code=status_from_code(value),
        message=decode_grpc_message(message.decode("utf-8", "surrogateescape")),
        metadata=decode_metadata(headers),
    )


def _field(headers: Headers, name: bytes) -> str | None:
    """The first value of a field, as text (latin-1 maps every byte, so it cannot fail)."""
    return next((value.decode("latin-1") for key, value in headers if key == name), None)


def _is_grpc_content_type(value: str) -> bool:
    """Whether a content type is application/grpc, optionally with "+subtype" or parameters."""
    value = value.lower()
    return value == "application/grpc" or value.startswith(
        ("application/grpc+", "application/grpc;")
    )
