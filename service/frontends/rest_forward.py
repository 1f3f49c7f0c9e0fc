"""A front-end's REST listener: an ASGI app that passes each request on to the parent as one
dispatch call (rest_tunnel.py) and relays the answer, its body as it arrives. The client
leaving (its connection closed, its stream reset) cancels the call at the parent, whose app
then sees `http.disconnect`, as over TCP in a single process."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, NoReturn, Protocol

import grpc

from service.frontends.protocol import Open
from service.frontends.rest_tunnel import REST_METHOD, TRANSPORT, decode_start, encode_head
from service.http.asgi import Receive, Scope, Send, lifespan
from service.http.status import http_status


class Relay(Protocol):
    """What the forwarder uses of the front-end's dispatch connection (`ParentLink`)."""

    max_payload: int

    def relay(
        self, opened: Open, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]: ...


class _Ended(Exception):
    """The call's status at the parent, when it is not OK."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _ClientGone(Exception):
    """The client left while its body was being passed on."""


class _Context:
    """What `relay` tells of the call: no metadata for REST, a status other than OK raised."""

    async def send_initial_metadata(self, metadata: Any) -> None:
        return None

    def set_trailing_metadata(self, metadata: Any) -> None:
        return None

    async def abort(self, code: grpc.StatusCode, details: str, trailing: Any = ()) -> NoReturn:
        raise _Ended(code, details)


class RestForwarder:
    def __init__(self, link: Relay) -> None:
        self._link = link

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "unknown"
        opened = Open(REST_METHOD, TRANSPORT, peer, None, ())
        body_done = asyncio.Event()
        answers = self._link.relay(opened, self._request(scope, receive, body_done), _Context())
        relay = asyncio.ensure_future(_relay(answers, send))
        gone = asyncio.ensure_future(_gone(receive, body_done))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not relay.done():
                relay.cancel()  # the relay's end tells the parent the client left
            with contextlib.suppress(asyncio.CancelledError, _ClientGone):
                await relay

    async def _request(
        self, scope: Scope, receive: Receive, body_done: asyncio.Event
    ) -> AsyncIterator[bytes]:
        """The request's head, then its body as it arrives, in messages the link carries."""
        yield encode_head(scope)
        limit = self._link.max_payload // 2
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            body = bytes(message.get("body", b""))
            for start in range(0, len(body), limit):
                yield body[start : start + limit]
            if not message.get("more_body", False):
                break
        body_done.set()


async def _relay(answers: AsyncIterator[bytes], send: Send) -> None:
    """The parent's answers to the client: the response's start, then its body."""
    started = False
    try:
        async for answer in answers:
            if started:
                await send({"type": "http.response.body", "body": answer, "more_body": True})
            else:
                await send(decode_start(answer))
                started = True
    except _Ended as exc:
        if started:
            return  # the client sees the body end short: the parent failed mid-answer
        body = json.dumps({"error": exc.details}).encode()
        await send(
            {
                "type": "http.response.start",
                # UNKNOWN: the parent's app failed, a server error.
                "status": 500 if exc.code is grpc.StatusCode.UNKNOWN else http_status(exc.code),
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return
    if not started:
        raise RuntimeError("the parent ended a REST call without an answer")
    await send({"type": "http.response.body", "body": b""})


async def _gone(receive: Receive, body_done: asyncio.Event) -> None:
    """Returns when the client leaves after its body was passed on."""
    await body_done.wait()
    while (await receive())["type"] != "http.disconnect":
        pass
