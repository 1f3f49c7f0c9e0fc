"""One exception type that carries a gRPC status, raised anywhere in the request path."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc

# What servicers receive on every transport (the HTTP/3 one behaves the same way).
ServicerContext = grpc.aio.ServicerContext[Any, Any]


class ServiceError(Exception):
    """A request failed with a gRPC status code and a message meant for the caller."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"ServiceError({self.code.name}, {self.message!r})"


# Characters of a caller's string (a name, a datatype) that an error message repeats: a
# megabyte-long name must not make a megabyte-long status.
ECHO_LIMIT = 64


def echoed(text: str) -> str:
    """A caller's string as an error message quotes it, cut to ECHO_LIMIT characters."""
    if len(text) <= ECHO_LIMIT:
        return text
    return f"{text[:ECHO_LIMIT]}... ({len(text)} characters)"


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.NOT_FOUND, message)


def unavailable(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message)


def failed_precondition(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message)


def internal(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INTERNAL, message)


def deadline_exceeded(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, message)


def resource_exhausted(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


async def abort(context: ServicerContext, exc: ServiceError) -> NoReturn:
    await context.abort(exc.code, exc.message)


_Self = TypeVar("_Self")
_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


def reports_errors(
    method: Callable[[_Self, _Request, ServicerContext], Awaitable[_Response]],
) -> Callable[[_Self, _Request, ServicerContext], Awaitable[_Response]]:
    """A unary servicer method whose ServiceErrors reach the caller as their status (an
    uncaught exception would be UNKNOWN)."""

    @functools.wraps(method)
    async def wrapper(self: _Self, request: _Request, context: ServicerContext) -> _Response:
        try:
            return await method(self, request, context)
        except ServiceError as exc:
            # Aborted outside the except block and without its traceback: otherwise the
            # error, its traceback and this frame form a cycle that keeps the request (up to a
            # message's size) alive until the collector's next full pass.
            error = exc.with_traceback(None)
        await abort(context, error)

    return wrapper


class WorkerDied(ServiceError):
    """The worker died (or was killed by the watchdog) holding this request. `running`: it was
    the request being computed, not one waiting behind it in the worker."""

    def __init__(self, message: str, running: bool) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.running = running
