"""The REST API as a plain ASGI application: the path picks a route, a request's body is read
within its bounds (size, time), and a route's failure becomes Triton's `{"error": ...}` with
its HTTP status. No framework: routing is a split path, and the bounds are this module's."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from contextvars import Token
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry.context import Context as OtelContext

from service.dataplane.shared_memory import Peer
from service.http.asgi import Receive, Scope, Send, lifespan
from service.http.batchstream import BatchStreams
from service.http.callers import rest_client, rest_identity
from service.http.encoding import EncodingError, deflated, inflated, preferred
from service.http.generate import sse
from service.http.observed import TRANSPORT, observe
from service.http.openai import OpenAIRoutes, error_document
from service.http.routes import Reply, Routes
from service.http.shared_memory_routes import rest_peer
from service.http.status import RETRY_AFTER_S, error_status
from service.inference import errors
from service.inference.identity import ANYONE, Identity
from service.observability.metrics import UNKNOWN
from service.observability.observer import Observation, Observer

_T = TypeVar("_T")

_JSON = (b"content-type", b"application/json")
# A stream of events, passed on as it comes by proxies too.
_SSE = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
# Triton's binary tensor data extension: where a body's JSON ends and its binary data begins.
_HEADER_LENGTH = b"inference-header-content-length"


@dataclass(frozen=True)
class RequestLimits:
    max_header_bytes: int  # a request's header block, RFC 9114 size (--max-metadata-bytes)
    max_body_bytes: int  # per request (--http-max-input-size)
    body_timeout_s: float  # for all of one request's body (--http-body-timeout)
    max_requests: int  # handled at once, every connection together (--max-concurrent-rpcs)
    stall_s: float  # a stream's client may take no event this long (--stream-stall-timeout)


class Refused(Exception):
    """A request answered before its route runs (its body too large or too slow, an unknown
    path); `close`: its connection cannot carry another request (a body left unread); `code`:
    what metrics and the request log count it as, in gRPC's terms as every other call."""

    def __init__(
        self,
        status: int,
        message: str,
        close: bool = False,
        code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close
        self.code = code


@dataclass
class Call:
    """What the request log, metrics and trace say of one request: the gRPC method its route
    stands for (the same labels as gRPC's calls, `transport="http"`), its model and outcome;
    once routed, its observation (service/http/observed.py)."""

    rpc: str = UNKNOWN
    model: str = ""
    version: str = ""
    request_id: str = ""
    code: grpc.StatusCode = grpc.StatusCode.OK
    error: str = ""
    encoding: str | None = None  # the response's Content-Encoding (None: identity)
    client: str = ""  # whom it counts against for a fair share: certificate, else address
    identity: Identity = ANYONE  # its client certificate's (service/http/callers.py)
    observation: Observation | None = None  # a routed request's
    trace: Token[OtelContext] | None = None  # its span made current, until it ends


# The restricted-protocol check of a route: given the name of the gRPC method it stands for and
# the request's headers, the header it lacks (None: served).
Guard = Callable[[str, list[tuple[bytes, bytes]]], str | None]


class RestApp:
    def __init__(
        self,
        routes: Routes,
        limits: RequestLimits,
        observer: Observer | None,
        guard: Guard | None = None,
    ) -> None:
        """`observer`: where each request is counted and logged (None: nowhere); `guard`:
        what --restricted-protocol asks of a route's request (None: nothing)."""
        self.routes = routes
        self.limits = limits
        self.observer = observer
        self.guard = guard
        self.openai = OpenAIRoutes(routes.plane)
        self.batchstream = BatchStreams(routes.plane, limits.body_timeout_s)
        self.in_flight = 0  # requests being handled, their bodies' reading included

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        started = time.perf_counter()
        call = Call(identity=rest_identity(scope))
        call.client = rest_client(scope, call.identity)
        try:
            await self._answer(scope, receive, send, call)
        except asyncio.CancelledError:
            call.code, call.error = grpc.StatusCode.CANCELLED, "the request was cancelled"
            raise
        except Exception as exc:
            call.code, call.error = grpc.StatusCode.INTERNAL, repr(exc)
            raise
        finally:
            observation = call.observation
            if observation is not None:
                observation.model, observation.version = call.model, call.version
                observation.request_id = call.request_id
                observation.end(call.code, lambda: call.error)
            elif self.observer is not None:
                self._record(call, time.perf_counter() - started)
            if call.trace is not None:
                otel_context.detach(call.trace)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        headers: list[tuple[bytes, bytes]] = [_JSON]
        self.in_flight += 1
        try:
            reply = await self._admitted(scope, receive, call)
        except Refused as exc:
            reply = Reply(exc.status, _error(scope, exc.status, exc.message, exc))
            call.code, call.error = exc.code, exc.message
            if exc.close and scope.get("http_version") in ("1.0", "1.1"):
                headers.append((b"connection", b"close"))
        except errors.ServiceError as exc:
            status = error_status(exc)
            reply = Reply(status, _error(scope, status, exc.message, exc))
            call.code, call.error = exc.code, exc.message
        finally:
            self.in_flight -= 1
        call.request_id = reply.request_id
        call.version = reply.model_version or call.version
        if reply.status == 429:
            headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
        if reply.events is not None:
            await self._stream(reply.events, send, reply.gone or receive, call)
            return
        body = b"" if reply.document is None else json.dumps(reply.document).encode()
        if reply.document is None:
            headers.remove(_JSON)
        if reply.binary:
            headers.remove(_JSON)
            headers.append((b"content-type", b"application/octet-stream"))
            headers.append((_HEADER_LENGTH, str(len(body)).encode()))
            body = b"".join((body, *reply.binary))
        if call.encoding is not None and reply.status == 200:
            body = await deflated(body, call.encoding)
            headers.append((b"content-encoding", call.encoding.encode()))
        headers.append((b"content-length", str(len(body)).encode()))
        await self._start(send, call, reply.status, headers)
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    async def _start(
        send: Send, call: Call, status: int, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """The response's start, its status on the request's span."""
        span = call.observation.span if call.observation is not None else None
        if span is not None:
            span.set_attribute("http.response.status_code", status)
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _stream(
        self, events: AsyncGenerator[bytes, None], send: Send, receive: Receive, call: Call
    ) -> None:
        """Server-sent events as they come, until the last, an error (sent in-band: the status
        went with the first), the client leaving (the model's request is cancelled) or the
        client taking no event for --stream-stall-timeout (cancelled too)."""
        await self._start(send, call, 200, list(_SSE))

        async def relay() -> None:
            try:
                async for chunk in events:
                    async with asyncio.timeout(self.limits.stall_s):
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except errors.ServiceError as exc:
                call.code, call.error = exc.code, exc.message
                await send({"type": "http.response.body", "body": sse({"error": exc.message})})
            except TimeoutError:
                call.code = grpc.StatusCode.RESOURCE_EXHAUSTED
                call.error = f"the client took no event for {self.limits.stall_s:g} s"
                return
            finally:
                await events.aclose()
            await send({"type": "http.response.body", "body": b""})

        try:
            await unless_gone(receive, relay())
        except Refused as exc:
            call.code, call.error = exc.code, exc.message

    def _record(self, call: Call, seconds: float) -> None:
        """A request answered before it was routed (no route, its headers too large, too many
        requests at once): counted and logged as the others, without a span (as gRPC calls
        their transport answers before any handler runs)."""
        assert self.observer is not None
        fields = {
            "model": call.model,
            "version": call.version,
            "transport": TRANSPORT,
            "rpc": call.rpc,
            "request_id": call.request_id,
        }
        self.observer.record(
            TRANSPORT,
            call.rpc,
            call.model,
            call.version,
            call.code,
            seconds,
            fields,
            lambda: call.error,
        )

    async def _admitted(self, scope: Scope, receive: Receive, call: Call) -> Reply:
        """The route's reply, unless the server already handles as many REST requests as it
        may (refused before the body is read, which the refusal's connection closes on)."""
        if self.in_flight > self.limits.max_requests:
            raise Refused(
                429,
                f"the server handles at most {self.limits.max_requests} REST requests at once "
                "(--max-concurrent-rpcs); try again",
                close=True,
                code=grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        return await self._route(scope, receive, call)

    def _expect(self, scope: Scope, call: Call, allowed: str, rpc: str, route: str) -> None:
        """The request routed to `route` (its template), standing for the gRPC method `rpc`:
        observed from here on (its span current for the work it starts), once its method is
        the one its route takes and it carries the header its category is restricted to (403
        in Triton's words otherwise, before its body is read)."""
        call.rpc = rpc
        if self.observer is not None:
            call.observation = observe(self.observer, scope, rpc, route)
            call.trace = call.observation.attach()
        if scope["method"] != allowed:
            raise Refused(
                405,
                f"this route takes {allowed}, not {scope['method'][:16]}",
                code=grpc.StatusCode.UNIMPLEMENTED,
            )
        missing = self.guard(rpc, scope["headers"]) if self.guard is not None else None
        if missing is not None:
            raise Refused(
                403,
                f"This API is restricted, expecting header '{missing}'",
                code=grpc.StatusCode.UNAUTHENTICATED,
            )

    async def _v1(self, scope: Scope, receive: Receive, call: Call, rest: list[str]) -> Reply:
        """The OpenAI-compatible routes and batchstream (service/http/openai.py,
        batchstream.py)."""
        if rest == ["models"]:
            self._expect(scope, call, "GET", "RepositoryIndex", "/v1/models")
            return self.openai.models()
        if rest in (["completions"], ["chat", "completions"]):
            self._expect(scope, call, "POST", "ModelStreamInfer", "/v1/" + "/".join(rest))
            body = await read_body(scope, receive, self.limits)
            work = self.openai.completions(body, rest[0] == "chat", call.client, call)
            return await unless_gone(receive, work)
        if rest == ["inference", "advanced", "batchstream"]:
            route = "/v1/inference/advanced/batchstream"
            self._expect(scope, call, "POST", "ModelStreamInfer", route)
            return self.batchstream.reply(receive, call.client)
        raise _no_route(scope)

    async def _route(self, scope: Scope, receive: Receive, call: Call) -> Reply:
        """The route the path names, its gRPC method's name in `call` (UNKNOWN: no route)."""
        _check_headers(scope, self.limits.max_header_bytes)
        parts = scope["path"].strip("/").split("/")
        rest = parts[1:]
        if parts[0] == "v1":
            return await self._v1(scope, receive, call, rest)
        if parts[0] != "v2":
            raise _no_route(scope)
        if not rest:
            self._expect(scope, call, "GET", "ServerMetadata", "/v2")
            return self.routes.server_metadata()
        if rest in (["health", "live"], ["health", "ready"]):
            health = "ServerLive" if rest[1] == "live" else "ServerReady"
            self._expect(scope, call, "GET", health, f"/v2/health/{rest[1]}")
            return self.routes.live() if rest[1] == "live" else self.routes.ready()
        if rest == ["repository", "index"]:
            self._expect(scope, call, "POST", "RepositoryIndex", "/v2/repository/index")
            return await self.routes.repository_index(await read_body(scope, receive, self.limits))
        if rest[:2] == ["repository", "models"] and len(rest) == 4 and rest[3] in _CONTROL:
            route = f"/v2/repository/models/{{model}}/{rest[3]}"
            self._expect(scope, call, "POST", _CONTROL[rest[3]], route)
            call.model = rest[2]
            body = await read_body(scope, receive, self.limits)
            control = self.routes.load if rest[3] == "load" else self.routes.unload
            return await control(rest[2], body)
        if rest[0] in _SHARED_MEMORY:
            return await self._shared_memory(scope, receive, call, rest)
        if rest == ["models", "stats"]:
            self._expect(scope, call, "GET", "ModelStatistics", "/v2/models/stats")
            return self.routes.statistics("", "")
        if rest[0] != "models" or len(rest) < 2:
            raise _no_route(scope)
        model, rest = rest[1], rest[2:]
        version = ""
        if rest[:1] == ["versions"] and len(rest) >= 2:
            version, rest = rest[1], rest[2:]
        action = rest[0] if len(rest) == 1 else "" if not rest else None
        rpc = _MODEL_ROUTES.get(action) if action is not None else None
        if rpc is None:
            raise _no_route(scope)
        posted = action in ("infer", "generate", "generate_stream")
        route = "/v2/models/{model}" + ("/versions/{version}" if version else "")
        route += f"/{action}" if action else ""
        self._expect(scope, call, "POST" if posted else "GET", rpc, route)
        call.model, call.version = model, version
        if action in ("generate", "generate_stream"):
            body = await read_body(scope, receive, self.limits)
            stream = action == "generate_stream"
            work = self.routes.generate(model, version, body, stream, call.client)
            return await unless_gone(receive, work)
        if action == "infer":
            body = await read_body(scope, receive, self.limits)
            body = await _decoded(scope, body, self.limits.max_body_bytes)
            call.encoding = preferred(_header(scope, b"accept-encoding"))
            header_length = _header(scope, _HEADER_LENGTH)
            peer = _peer(scope)
            refusal = (
                self.guard("SystemSharedMemoryRegister", scope["headers"])
                if self.guard is not None
                else None
            )
            return await unless_gone(
                receive,
                self.routes.infer(
                    model, version, body, header_length, peer, call.identity, refusal
                ),
            )
        if action == "ready":
            return self.routes.model_ready(model, version)
        if action == "config":
            return await self.routes.model_config(model, version)
        if action == "stats":
            return self.routes.statistics(model, version)
        return await self.routes.model_metadata(model, version)

    async def _shared_memory(
        self, scope: Scope, receive: Receive, call: Call, rest: list[str]
    ) -> Reply:
        """`/v2/{system,cuda}sharedmemory/status|unregister` (every region) and
        `.../region/NAME/status|register|unregister`: the gRPC method of each, its category
        restricted as that method's."""
        if len(rest) == 2 and rest[1] in ("status", "unregister"):
            name, action = "", rest[1]
        elif len(rest) == 4 and rest[1] == "region" and rest[3] in _SHARED_MEMORY_ACTIONS:
            name, action = rest[2], rest[3]
        else:
            raise _no_route(scope)
        kind = _SHARED_MEMORY[rest[0]]
        rpc = f"{kind}SharedMemory{action.capitalize()}"
        route = f"/v2/{rest[0]}" + ("/region/{region}" if name else "") + f"/{action}"
        self._expect(scope, call, "GET" if action == "status" else "POST", rpc, route)
        peer = _peer(scope)
        body = b"" if action == "status" else await read_body(scope, receive, self.limits)
        shared = self.routes.shared_memory
        if kind == "Cuda":
            if action == "status":
                return Reply(200, shared.cuda_status(peer, name))
            if action == "register":
                shared.cuda_register(peer, name)
            shared.cuda_unregister(peer)
            return Reply(200)
        if action == "status":
            return Reply(200, await shared.status(peer, name))
        if action == "register":
            await shared.register(peer, name, body)
        else:
            await shared.unregister(peer, name)
        return Reply(200)


def _error(scope: Scope, status: int, message: str, exc: Exception) -> Any:
    """The error body in the words of the route's API: OpenAI's under /v1, Triton's else."""
    if scope["path"].startswith("/v1/"):
        return error_document(status, message, exc)
    return {"error": message}


# /v2/{system,cuda}sharedmemory/... and the kind of the gRPC methods they stand for.
_SHARED_MEMORY = {"systemsharedmemory": "System", "cudasharedmemory": "Cuda"}
_SHARED_MEMORY_ACTIONS = ("status", "register", "unregister")
# /v2/repository/models/NAME/... and the gRPC methods they stand for.
_CONTROL = {"load": "RepositoryModelLoad", "unload": "RepositoryModelUnload"}
# The routes under /v2/models/NAME[/versions/V]/ and the gRPC methods they stand for.
_MODEL_ROUTES = {
    "": "ModelMetadata",
    "ready": "ModelReady",
    "config": "ModelConfig",
    "stats": "ModelStatistics",
    "infer": "ModelInfer",
    "generate": "ModelInfer",
    "generate_stream": "ModelStreamInfer",
}


async def read_body(scope: Scope, receive: Receive, limits: RequestLimits) -> bytes:
    """The request's body, at most `max_bytes` (a larger Content-Length is refused before
    anything is read, a longer chunked body as soon as it passes the limit), all of it within
    `timeout_s`."""
    declared = _content_length(scope)
    if declared is not None and declared > limits.max_body_bytes:
        raise Refused(
            400,
            f"the request body has {declared} bytes, more than --http-max-input-size "
            f"{limits.max_body_bytes}; refused before reading it",
            close=True,
            code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
    body = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise Refused(
                        400,
                        "the client went away before its body ended",
                        close=True,
                        code=grpc.StatusCode.CANCELLED,
                    )
                body += message.get("body", b"")
                if len(body) > limits.max_body_bytes:
                    raise Refused(
                        400,
                        f"the request body has more than --http-max-input-size "
                        f"{limits.max_body_bytes} bytes",
                        close=True,
                        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                    )
                if not message.get("more_body", False):
                    return bytes(body)
    except TimeoutError:
        raise Refused(
            408,
            f"the request body took more than --http-body-timeout {limits.body_timeout_s:g} s "
            f"({len(body)} bytes arrived)",
            close=True,
            code=grpc.StatusCode.DEADLINE_EXCEEDED,
        ) from None


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


async def _decoded(scope: Scope, body: bytes, limit: int) -> bytes:
    """The body before its Content-Encoding (Triton's: gzip, deflate), within `limit`."""
    encoding = _header(scope, b"content-encoding")
    if encoding is None:
        return body
    try:
        return await inflated(body, encoding, limit)
    except EncodingError as exc:
        if exc.unsupported:
            raise Refused(501, str(exc), code=grpc.StatusCode.UNIMPLEMENTED) from None
        raise Refused(400, str(exc)) from None


def _check_headers(scope: Scope, limit: int) -> None:
    """The server library bounds a header block while it is incomplete (h11) or by the size
    it advertised (h2); one that arrived whole in a single read is measured here."""
    size = sum(len(name) + len(value) + 32 for name, value in scope["headers"])
    if size > limit:
        raise Refused(
            431,
            f"the request's headers have {size} bytes, more than {limit}",
            close=True,
            code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        )


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise Refused(400, "Content-Length is not a number", close=True) from None


def _header(scope: Scope, wanted: bytes) -> str | None:
    """A header's value (the first, if sent more than once); ASGI names are lower case."""
    for name, value in scope["headers"]:
        if name == wanted:
            return bytes(value).decode("latin-1")
    return None


def _peer(scope: Scope) -> Peer:
    return rest_peer(scope.get("client"), scope.get("server"), scope.get("http_version", ""))


def _no_route(scope: Scope) -> Refused:
    return Refused(
        404, f"no route {errors.echoed(scope['path'])!r}", code=grpc.StatusCode.UNIMPLEMENTED
    )
