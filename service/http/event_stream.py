"""A reply's server-sent events relayed to its client as they come, within the time the client
may take to read each (--stream-stall-timeout), until the last, an error or the client leaving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

import grpc

from service.http.asgi import Receive, Send
from service.http.bounds import Refused
from service.http.generate import sse
from service.http.leaving import unless_gone
from service.http.observed import Call
from service.inference import errors

# A stream of events, passed on as it comes by proxies too.
SSE = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


async def relay(
    events: AsyncGenerator[bytes, None],
    send: Send,
    receive: Receive,
    call: Call,
    stall_s: float,
    ending: Callable[[], None],
) -> None:
    """The events after the response's start (SSE's headers): an error is sent in-band (the
    status went with the start), and the client leaving or taking no event for `stall_s`
    cancels the model's request; `call` says how it ended, `ending` is told before the
    stream's end is sent (it may be told twice)."""

    async def relayed() -> None:
        try:
            async for chunk in events:
                async with asyncio.timeout(stall_s):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except errors.ServiceError as exc:
            call.code, call.error = exc.code, exc.message
            ending()
            await send({"type": "http.response.body", "body": sse({"error": exc.message})})
        except TimeoutError:
            call.code = grpc.StatusCode.RESOURCE_EXHAUSTED
            call.error = f"the client took no event for {stall_s:g} s"
            return
        finally:
            await events.aclose()
        ending()
        await send({"type": "http.response.body", "body": b""})

    try:
        await unless_gone(receive, relayed())
    except Refused as exc:
        call.code, call.error = exc.code, exc.message
