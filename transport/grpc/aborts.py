"""An aborted call's request freed when the call ends, not at the next full collection.

grpc.aio keeps an aborted call's AbortError in a reference cycle (its call state holds the
error, whose traceback holds the frames it passed through, one of which holds the call state),
so every frame of ours that the abort passed through, and the request each holds, lives until
the collector's oldest generation runs. Measured with the chaos row "BYTES element bomb
(--frontends 2)": a front-end refusing 3 MB requests grew by about 30 MB per ten of them, and a
bare grpc.aio server that aborts does the same (flat once the abort is re-raised as below). The
outermost behavior therefore re-raises the abort alone: without the frames it came through,
without the exception it was raised while handling, and with no reference of its own to the
request."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator
from typing import Any

from grpc.aio import AbortError

from transport.grpc.wrapping import HANDLER_BUILDERS, Behavior, Handler, WrappingServer, behavior_of


def releasing(behavior: Behavior) -> Behavior:
    """`behavior` (a coroutine or async generator function of any handler kind), its aborts
    keeping nothing it saw alive; anything else is returned as it is."""
    if inspect.isasyncgenfunction(behavior):

        async def released_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            responses = behavior(request, context)
            del request  # the behavior's frame holds it while it runs
            response = None
            try:
                async with contextlib.aclosing(responses):
                    async for response in responses:
                        yield response
                return
            except AbortError as exc:
                aborted = exc
            response = None
            try:
                raise _alone(aborted)
            finally:
                del aborted  # else this frame, in the traceback, holds what holds it

        return released_stream
    if inspect.iscoroutinefunction(behavior):

        async def released(request: Any, context: Any) -> Any:
            answer = behavior(request, context)
            del request
            try:
                return await answer
            except AbortError as exc:
                aborted = exc
            try:
                raise _alone(aborted)
            finally:
                del aborted

        return released
    return behavior


def _alone(aborted: AbortError) -> AbortError:
    aborted.__context__ = aborted.__cause__ = None
    return aborted.with_traceback(None)


class ReleasingServer(WrappingServer):
    """Registers every handler released (`releasing`); it sits next to the grpc.aio server, so
    that its behavior is the outermost one."""

    def wrap(self, method_path: str, handler: Handler) -> Handler:
        return HANDLER_BUILDERS[handler.request_streaming, handler.response_streaming](
            releasing(behavior_of(handler)),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
