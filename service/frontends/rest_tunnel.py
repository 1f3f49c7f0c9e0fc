"""REST requests that front-ends pass on to the parent. Each is one dispatch call of
`REST_METHOD` on the transport `http`: its messages are the request's head (method, path,
headers, client) then its body as it arrives, and its answers are the response's start
(status, headers) then its body. The parent runs them through the same `RestApp` as a single
process, so routes, bounds, access checks and observation are one implementation; a front-end
terminates TCP, TLS and HTTP and parses no JSON."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
from grpc.aio import EOF  # type: ignore[attr-defined]

from service.frontends.protocol import ProtocolViolation
from service.http.app import RestApp
from service.http.asgi import Message, Scope

REST_SERVICE = "paddlequic.frontends.Rest"
REST_METHOD = f"/{REST_SERVICE}/Serve"
TRANSPORT = "http"  # the dispatch table REST calls run on (no gRPC method is registered there)
CHUNK = 1 << 20  # the most response body bytes one answer carries
_DISCONNECT: Message = {"type": "http.disconnect"}


def encode_head(scope: Scope) -> bytes:
    """What the parent needs of an ASGI HTTP scope (bytes as latin-1: every byte survives)."""
    client, server = scope.get("client"), scope.get("server")
    return json.dumps(
        {
            "method": scope["method"],
            "scheme": scope.get("scheme", "http"),
            "http_version": scope.get("http_version", "1.1"),
            "path": scope["path"],
            "raw_path": bytes(scope.get("raw_path") or b"").decode("latin-1"),
            "query_string": bytes(scope.get("query_string", b"")).decode("latin-1"),
            "headers": [
                [bytes(n).decode("latin-1"), bytes(v).decode("latin-1")]
                for n, v in scope["headers"]
            ],
            "client": list(client) if client else None,
            # The connection's own end: whose socket it is (shared memory) is looked up exactly.
            "server": list(server) if server else None,
            # ASGI's TLS extension (JSON as it is): the client's certificate, whose identity the
            # parent knows the caller by, as gRPC calls' identity comes with them.
            "tls": scope.get("extensions", {}).get("tls"),
        }
    ).encode()


def decode_head(payload: bytes) -> Scope:
    try:
        head = json.loads(payload)
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "method": str(head["method"]),
            "scheme": str(head["scheme"]),
            "http_version": str(head["http_version"]),
            "path": str(head["path"]),
            "raw_path": head["raw_path"].encode("latin-1"),
            "query_string": head["query_string"].encode("latin-1"),
            "root_path": "",
            "headers": [(n.encode("latin-1"), v.encode("latin-1")) for n, v in head["headers"]],
            "client": tuple(head["client"]) if head["client"] else None,
            "server": tuple(head["server"]) if head.get("server") else None,
            "extensions": {"tls": dict(head["tls"])} if head.get("tls") else {},
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolViolation(f"a REST request's head that does not parse: {exc}") from None


def encode_start(message: Message) -> bytes:
    headers = [
        [bytes(n).decode("latin-1"), bytes(v).decode("latin-1")]
        for n, v in message.get("headers", ())
    ]
    return json.dumps({"status": int(message["status"]), "headers": headers}).encode()


def decode_start(payload: bytes) -> Message:
    start = json.loads(payload)
    return {
        "type": "http.response.start",
        "status": int(start["status"]),
        "headers": [(n.encode("latin-1"), v.encode("latin-1")) for n, v in start["headers"]],
    }


class RestTunnel(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """The parent's handler of `REST_METHOD`: runs `app` on each request passed on."""

    def __init__(self, app: RestApp) -> None:
        self._app = app

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if handler_call_details.method != REST_METHOD:
            return None
        return grpc.stream_stream_rpc_method_handler(self._serve)

    async def _serve(self, requests: Any, context: Any) -> None:
        """A coroutine, not a generator: a cancel (the client left) lands here wherever the
        call waits, and becomes the app's `http.disconnect`, as on a TCP connection."""
        head = await context.read()
        if head is EOF:
            return
        exchange = _Exchange(context)
        task = asyncio.ensure_future(self._app(decode_head(head), exchange.receive, exchange.send))
        try:
            while (answer := await exchange.next(task)) is not None:
                await context.write(answer)
            task.result()  # the app's own failure, if any
        finally:
            if not task.done():
                exchange.gone.set()
                await asyncio.wait({task})


class _Exchange:
    """One request's ASGI `receive` and `send` over its dispatch call; a response's body
    goes on in answers of at most CHUNK bytes, one at a time (the app's `send` waits while
    the front-end has not taken the last)."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self._body_done = False
        self.gone = asyncio.Event()  # the client left: nothing more is sent
        self._answers: asyncio.Queue[bytes] = asyncio.Queue(maxsize=1)

    async def receive(self) -> Message:
        if self._body_done or self.gone.is_set():
            await self.gone.wait()
            return _DISCONNECT
        read = asyncio.ensure_future(self._context.read())
        gone = asyncio.ensure_future(self.gone.wait())
        await asyncio.wait({read, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not read.done():
            read.cancel()
            return _DISCONNECT
        chunk = read.result()
        if chunk is EOF:
            self._body_done = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(self, message: Message) -> None:
        if self.gone.is_set():
            return
        if message["type"] == "http.response.start":
            await self._answers.put(encode_start(message))
            return
        body = bytes(message.get("body", b""))
        for start in range(0, len(body), CHUNK):
            await self._answers.put(body[start : start + CHUNK])

    async def next(self, task: asyncio.Future[None]) -> bytes | None:
        """The next answer to pass on; None once the app returned and every one was."""
        if self._answers.empty() and not task.done():
            taken = asyncio.ensure_future(self._answers.get())
            waited: set[asyncio.Future[Any]] = {taken, task}
            try:
                await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
                if taken.done():
                    return taken.result()
            finally:
                # Also when this call is cancelled (its client left): a get left waiting
                # would be destroyed pending ("Task was destroyed but it is pending!").
                taken.cancel()
        return None if self._answers.empty() else self._answers.get_nowait()
