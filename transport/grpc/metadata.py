"""Custom metadata <-> HTTP header fields: key rules, reserved names, base64 for -bin keys."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable

import grpc

from transport.grpc.errors import ProtocolError

Metadata = tuple[tuple[str, str | bytes], ...]

_KEY_RE = re.compile(r"[0-9a-z_.\-]+")
_PRINTABLE_RE = re.compile(rb"[\x20-\x7e]*")

# Fields the transport itself sets or HTTP/3 forbids (RFC 9114 4.2); never metadata.
_TRANSPORT_FIELDS = frozenset(
    {
        "connection",
        "content-length",
        "content-type",
        "host",
        "keep-alive",
        "proxy-connection",
        "te",
        "transfer-encoding",
        "upgrade",
    }
)
# "grpc-" names are reserved for gRPC itself; these few travel as metadata in every runtime
# (rich error details, census tracing and tags).
_GRPC_METADATA = frozenset({"grpc-status-details-bin", "grpc-trace-bin", "grpc-tags-bin"})


def _is_reserved(key: str) -> bool:
    """Whether a (lowercase) field name belongs to the transport rather than the application."""
    if key.startswith("grpc-"):
        return key not in _GRPC_METADATA
    return key in _TRANSPORT_FIELDS


def encode_metadata(metadata: Iterable[tuple[str, str | bytes]]) -> list[tuple[bytes, bytes]]:
    """Header fields for application metadata; ValueError for what gRPC does not allow.

    Keys are lowercased. "-bin" values are base64 without padding (str values are taken as
    UTF-8); other values must be printable ASCII.
    """
    fields: list[tuple[bytes, bytes]] = []
    for key, value in metadata:
        name = key.lower()
        if _KEY_RE.fullmatch(name) is None:
            raise ValueError(f"invalid metadata key {key!r}: allowed characters are 0-9 a-z _ - .")
        if _is_reserved(name):
            raise ValueError(f"metadata key {key!r} is reserved for the transport")
        data = value if isinstance(value, bytes) else value.encode("utf-8")
        if name.endswith("-bin"):
            data = base64.b64encode(data).rstrip(b"=")
        elif _PRINTABLE_RE.fullmatch(data) is None:
            raise ValueError(
                f"value of metadata key {key!r} must be printable ASCII (use a -bin key for "
                f"binary data): {value!r}"
            )
        fields.append((name.encode("ascii"), data))
    return fields


def decode_metadata(headers: Iterable[tuple[bytes, bytes]]) -> Metadata:
    """Application metadata in a header block, skipping pseudo-headers and transport fields.

    Comma-joined "-bin" values are split into separate entries, as the spec requires.
    Non-printable ASCII values are dropped: the spec forbids failing on them, and keeping them
    would make echoing the metadata back fail.
    """
    entries: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name.startswith(b":"):
            continue
        key = name.decode("latin-1")
        if _KEY_RE.fullmatch(key) is None:
            raise ProtocolError(grpc.StatusCode.INTERNAL, f"invalid metadata key {key!r}")
        if _is_reserved(key):
            continue
        if key.endswith("-bin"):
            entries.extend((key, _decode_base64(key, part)) for part in value.split(b","))
        elif _PRINTABLE_RE.fullmatch(value) is not None:
            entries.append((key, value.decode("ascii")))
    return tuple(entries)


def _decode_base64(key: str, value: bytes) -> bytes:
    """Standard base64, padded or not (the spec requires accepting both)."""
    value = value.strip(b" \t")
    try:
        return base64.b64decode(value + b"=" * (-len(value) % 4), validate=True)
    except binascii.Error as error:
        raise ProtocolError(
            grpc.StatusCode.INTERNAL, f"metadata {key!r} is not valid base64: {value!r}"
        ) from error
