"""Triton's restricted protocols (`--grpc-restricted-protocol`), on both transports: RPCs fall
into categories, and a category given as `CATEGORIES:KEY=VALUE` is only served to calls whose
metadata carries `triton-grpc-protocol-KEY: VALUE` (Triton's header name, so its clients and
scripts work unchanged). Others get UNAUTHENTICATED; the server and other callers are unaffected.

Servicers register through `RestrictedServer`, which wraps the handlers of restricted methods
at registration, as `ObservedServer` does, so the check is one code path for grpc.aio and
HTTP/3 (which has no server interceptors)."""

from __future__ import annotations

import contextlib
import hmac
import inspect
import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from transport.grpc.wrapping import HANDLER_BUILDERS, Behavior, Handler, WrappingServer, behavior_of

HEADER_PREFIX = "triton-grpc-protocol-"

# Triton's categories, plus `control` for paddlequic.v1.Control. paddlequic serves no trace
# or logging RPC; those names are accepted so that Triton command lines work, and restrict
# nothing here.
RESTRICTABLE = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
    "control",
)

_INFERENCE = "/inference.GRPCInferenceService/"
_METHOD_CATEGORIES = {
    _INFERENCE + "ServerLive": "health",
    _INFERENCE + "ServerReady": "health",
    _INFERENCE + "ModelReady": "health",
    _INFERENCE + "ServerMetadata": "metadata",
    _INFERENCE + "ModelMetadata": "metadata",
    _INFERENCE + "ModelInfer": "inference",
    _INFERENCE + "ModelStreamInfer": "inference",
    _INFERENCE + "ModelConfig": "model-config",
    _INFERENCE + "ModelStatistics": "statistics",
    _INFERENCE + "RepositoryIndex": "model-repository",
    _INFERENCE + "RepositoryModelLoad": "model-repository",
    _INFERENCE + "RepositoryModelUnload": "model-repository",
    _INFERENCE + "SystemSharedMemoryStatus": "shared-memory",
    _INFERENCE + "SystemSharedMemoryRegister": "shared-memory",
    _INFERENCE + "SystemSharedMemoryUnregister": "shared-memory",
    _INFERENCE + "CudaSharedMemoryStatus": "shared-memory",
    _INFERENCE + "CudaSharedMemoryRegister": "shared-memory",
    _INFERENCE + "CudaSharedMemoryUnregister": "shared-memory",
}
# Every method of these services; reflection (only the public schema) and the test-only
# Testing service belong to no category and stay open.
_SERVICE_CATEGORIES = {
    "grpc.health.v1.Health": "health",
    "paddlequic.v1.Control": "control",
}
# gRPC metadata keys: lowercase ASCII letters, digits, `-`, `_`, `.`; `-bin` keys carry bytes.
_KEY = re.compile(r"[0-9a-z_.-]+")


class RestrictionError(ValueError):
    """A --restricted-protocol value that cannot be used; the message never holds the value."""


@dataclass(frozen=True)
class Restriction:
    header: str
    value: bytes

    def allows(self, metadata: Iterable[tuple[str, str | bytes]]) -> bool:
        """Whether the call's metadata carries the header with the value; compared in
        constant time so the comparison does not reveal how much of a guess was right."""
        allowed = False
        for key, value in metadata:
            if key == self.header:
                given = value.encode() if isinstance(value, str) else value
                allowed |= hmac.compare_digest(given, self.value)
        return allowed

    @property
    def refusal(self) -> str:
        """What a call without the header is told (UNAUTHENTICATED)."""
        return f"This protocol is restricted, expecting header '{self.header}'"

    @property
    def http_header(self) -> str:
        """The header a REST call carries instead: the key itself, as Triton's
        --http-restricted-api takes it."""
        return self.header.removeprefix(HEADER_PREFIX)


def rest_guard(
    restrictions: Mapping[str, Restriction],
) -> Callable[[str, list[tuple[bytes, bytes]]], str | None]:
    """The REST API's check: a route standing for inference.GRPCInferenceService's `rpc` is
    restricted as that method is, to requests carrying the key itself as a header (as
    Triton's --http-restricted-api has it); returns the header a request lacks."""

    def missing(rpc: str, headers: list[tuple[bytes, bytes]]) -> str | None:
        restriction = restriction_of(restrictions, _INFERENCE + rpc)
        if restriction is None:
            return None
        name = restriction.http_header
        sent = [(restriction.header, bytes(v)) for k, v in headers if k == name.encode()]
        return None if restriction.allows(sent) else name

    return missing


def restriction_of(restrictions: Mapping[str, Restriction], method_path: str) -> Restriction | None:
    """The restriction a method is served under, None for an open one."""
    category = category_of(method_path)
    return restrictions.get(category) if category else None


def category_of(method_path: str) -> str | None:
    """The restricted-protocol category of `/package.Service/Method`, None for open ones."""
    category = _METHOD_CATEGORIES.get(method_path)
    if category is None:
        service = method_path.lstrip("/").rpartition("/")[0]
        category = _SERVICE_CATEGORIES.get(service)
    return category


def parse_restrictions(specs: Sequence[str]) -> dict[str, Restriction]:
    """`CATEGORY[,CATEGORY...]:KEY=VALUE` per spec -> the restriction of each category. As in
    Triton, a category may appear in one spec only."""
    restrictions: dict[str, Restriction] = {}
    for spec in specs:
        categories, colon, setting = spec.partition(":")
        key, equals, value = setting.partition("=")
        key = key.strip().lower()
        if not colon or not equals:
            raise RestrictionError(
                f"--restricted-protocol takes CATEGORIES:KEY=VALUE, got {categories!r}"
                + ("" if colon else " without ':'")
            )
        if not _KEY.fullmatch(key) or key.endswith("-bin"):
            raise RestrictionError(
                f"--restricted-protocol key {key!r} is not a gRPC metadata key (lowercase "
                "letters, digits, '-', '_', '.'; not ending in -bin)"
            )
        if not value or not value.isascii() or not value.isprintable():
            raise RestrictionError(
                f"--restricted-protocol value for key {key!r} must be non-empty printable ASCII"
            )
        restriction = Restriction(HEADER_PREFIX + key, value.encode())
        for name in (c.strip() for c in categories.split(",")):
            if name not in RESTRICTABLE:
                raise RestrictionError(
                    f"unknown restricted protocol {name!r}; known: {', '.join(RESTRICTABLE)}"
                )
            if name in restrictions:
                raise RestrictionError(
                    f"protocol {name!r} can not be specified in multiple config groups"
                )
            restrictions[name] = restriction
    return restrictions


class RestrictedServer(WrappingServer):
    """Registers the handlers of restricted methods checking the call's metadata before
    anything else (wrapped around an `ObservedServer`, refusals are observed too)."""

    def __init__(self, server: Any, restrictions: Mapping[str, Restriction]) -> None:
        super().__init__(server)
        self._restrictions = dict(restrictions)

    def wrap(self, method_path: str, handler: Handler) -> Handler:
        restriction = restriction_of(self._restrictions, method_path)
        if restriction is None:
            return handler
        return HANDLER_BUILDERS[handler.request_streaming, handler.response_streaming](
            guarded(behavior_of(handler), restriction),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def guarded(behavior: Behavior, restriction: Restriction) -> Behavior:
    """The behavior behind the check; every kind becomes async (fail closed: nothing runs
    before the check, whatever the behavior is)."""

    async def check(context: Any) -> None:
        if not restriction.allows(context.invocation_metadata() or ()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, restriction.refusal)

    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            await check(context)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return guarded_stream

    async def guarded_call(request: Any, context: Any) -> Any:
        await check(context)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return guarded_call
