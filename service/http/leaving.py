"""A client that leaves before its answer: the work done for it is cancelled, not finished for
nobody."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

from service.http.asgi import Receive
from service.http.bounds import Refused

_T = TypeVar("_T")


async def unless_gone(receive: Receive, work: Coroutine[Any, Any, _T]) -> _T:
    """`work`'s reply; if the client goes away first (its connection closed, its HTTP/2 stream
    reset), `work` is cancelled, so a request waiting in a batch queue leaves it at once and
    one in a batch is no longer waited for. Its body read, the next message a request gets is
    `http.disconnect`, whenever its client leaves."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise Refused(499, "the client went away", code=grpc.StatusCode.CANCELLED)
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
