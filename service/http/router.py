"""The REST API's routes by path, with no framework: a split path picks the route, which names
the gRPC method it stands for (its labels, its restricted-protocol category) in the request's
`Call`, and whose method and category are checked before its body is read within its bounds."""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from service.dataplane.shared_memory import Peer
from service.http import openai
from service.http.asgi import Receive, Scope, header
from service.http.batchstream import BatchStreams
from service.http.bounds import (
    HEADER_LENGTH,
    Refused,
    RequestLimits,
    check_headers,
    decoded,
    read_body,
)
from service.http.encoding import preferred
from service.http.generate_route import GenerateRoute
from service.http.infer_route import InferRoute, PassedOn
from service.http.leaving import unless_gone
from service.http.observed import Call, observe
from service.http.openai import Completions
from service.http.reply import Reply
from service.http.routes import Routes
from service.http.shared_memory_routes import rest_peer
from service.http.textgen import generation_model, generation_models
from service.inference import errors
from service.observability.observer import Observer

# The restricted-protocol check of a route: given the name of the gRPC method it stands for and
# the request's headers, the header it lacks (None: served).
Guard = Callable[[str, list[tuple[bytes, bytes]]], str | None]


class InferRouter:
    """The infer route alone: what a front-end serves itself of REST (`route`), and what the
    full router does for it (`infer`). A request is observed (`observer`: None, nowhere)
    once it passes its route's method and `guard` (RestApp's)."""

    def __init__(
        self,
        inference: InferRoute,
        generation: GenerateRoute,
        completions: Completions,
        limits: RequestLimits,
        observer: Observer | None,
        guard: Guard | None,
        batchstream: BatchStreams,
    ) -> None:
        self.inference = inference
        self.generation = generation
        self.completions = completions
        self.limits = limits
        self.observer = observer
        self.guard = guard
        self.batchstream = batchstream

    async def route(self, scope: Scope, receive: Receive, call: Call) -> Reply:
        """An infer, generate, completions or batchstream request; any other is passed on,
        unread (PassedOn)."""
        check_headers(scope, self.limits.max_header_bytes)
        path = scope["path"]
        target = infer_target(path)
        if target is not None:
            return await self.infer(scope, receive, call, target)
        generating = generate_target(path)
        if generating is not None:
            return await self.generate(scope, receive, call, *generating)
        if path in COMPLETIONS:
            return await self.complete(scope, receive, call, path)
        if path == BATCHSTREAM:
            return self.stream_batch(scope, receive, call)
        raise PassedOn(f"no route served here {errors.echoed(path)!r}")

    def stream_batch(self, scope: Scope, receive: Receive, call: Call) -> Reply:
        """Batchstream: the route reads its body itself, a line at a time."""
        self._expect(scope, call, "POST", "ModelStreamInfer", BATCHSTREAM)
        return self.batchstream.reply(receive, call.client)

    async def complete(self, scope: Scope, receive: Receive, call: Call, path: str) -> Reply:
        """OpenAI's completions (`path`: one of COMPLETIONS)."""
        self._expect(scope, call, "POST", "ModelStreamInfer", path)
        body = await read_body(scope, receive, self.limits, call.held())
        chat = path == "/v1/chat/completions"
        work = self.completions.completions(body, chat, call.client, call)
        return await _answered(receive, work, body)

    async def generate(
        self, scope: Scope, receive: Receive, call: Call, model: str, version: str, action: str
    ) -> Reply:
        """`action`: generate or generate_stream."""
        route = "/v2/models/{model}" + ("/versions/{version}" if version else "") + f"/{action}"
        self._expect(scope, call, "POST", _MODEL_ROUTES[action], route)
        call.model, call.version = model, version
        body = await read_body(scope, receive, self.limits, call.held())
        stream = action == "generate_stream"
        work = self.generation.generate(model, version, body, stream, call.client)
        return await _answered(receive, work, body)

    async def infer(
        self, scope: Scope, receive: Receive, call: Call, target: tuple[str, str, str]
    ) -> Reply:
        """`target`: the model, the version and the route's template (infer_target)."""
        model, version, route = target
        self._expect(scope, call, "POST", "ModelInfer", route)
        call.model, call.version = model, version
        sent = await read_body(scope, receive, self.limits, call.held(), binary=True)
        body = await decoded(scope, sent, self.limits.max_body_bytes, call.held())
        call.encoding = preferred(header(scope, b"accept-encoding"))
        header_length = header(scope, HEADER_LENGTH)
        peer = _peer(scope)
        refusal = (
            self.guard("SystemSharedMemoryRegister", scope["headers"])
            if self.guard is not None
            else None
        )
        work = self.inference.infer(
            model, version, body, header_length, peer, call.identity, refusal
        )
        return await _answered(receive, work, sent)

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


class Router(InferRouter):
    """Each request's route."""

    def __init__(
        self,
        routes: Routes,
        limits: RequestLimits,
        observer: Observer | None,
        guard: Guard | None,
    ) -> None:
        plane = routes.plane
        batchstream = BatchStreams(
            plane,
            functools.partial(generation_model, plane),
            lambda: [served.name for served in generation_models(plane.models)],
            limits.body_timeout_s,
        )
        super().__init__(
            routes.inference,
            routes.generation,
            routes.completions,
            limits,
            observer,
            guard,
            batchstream,
        )
        self.routes = routes

    async def route(self, scope: Scope, receive: Receive, call: Call) -> Reply:
        """The route the path names, its gRPC method's name in `call` (UNKNOWN: no route)."""
        check_headers(scope, self.limits.max_header_bytes)
        target = infer_target(scope["path"])
        if target is not None:
            return await self.infer(scope, receive, call, target)
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
            return await self.routes.repository_index(
                await read_body(scope, receive, self.limits, call.held())
            )
        if rest[:2] == ["repository", "models"] and len(rest) == 4 and rest[3] in _CONTROL:
            route = f"/v2/repository/models/{{model}}/{rest[3]}"
            self._expect(scope, call, "POST", _CONTROL[rest[3]], route)
            call.model = rest[2]
            body = await read_body(scope, receive, self.limits, call.held())
            control = self.routes.load if rest[3] == "load" else self.routes.unload
            return await control(rest[2], body)
        if rest[0] in _SHARED_MEMORY:
            return await self._shared_memory(scope, receive, call, rest)
        if rest == ["models", "stats"]:
            self._expect(scope, call, "GET", "ModelStatistics", "/v2/models/stats")
            return await self.routes.statistics("", "")
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
        if action in _GENERATE:
            return await self.generate(scope, receive, call, model, version, action)
        route = "/v2/models/{model}" + ("/versions/{version}" if version else "")
        route += f"/{action}" if action else ""
        self._expect(scope, call, "GET", rpc, route)
        call.model, call.version = model, version
        if action == "ready":
            return self.routes.model_ready(model, version)
        if action == "config":
            return await self.routes.model_config(model, version)
        if action == "stats":
            return await self.routes.statistics(model, version)
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
        body = (
            b"" if action == "status" else await read_body(scope, receive, self.limits, call.held())
        )
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

    async def _v1(self, scope: Scope, receive: Receive, call: Call, rest: list[str]) -> Reply:
        """The OpenAI-compatible routes and batchstream (service/http/openai.py,
        batchstream.py)."""
        if rest == ["models"]:
            self._expect(scope, call, "GET", "RepositoryIndex", "/v1/models")
            return openai.models(self.routes.plane)
        path = "/v1/" + "/".join(rest)
        if path in COMPLETIONS:
            return await self.complete(scope, receive, call, path)
        if path == BATCHSTREAM:
            return self.stream_batch(scope, receive, call)
        raise _no_route(scope)


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
    "generate": "ModelInfer",
    "generate_stream": "ModelStreamInfer",
}
_GENERATE = ("generate", "generate_stream")
COMPLETIONS = ("/v1/completions", "/v1/chat/completions")  # OpenAI's, a request naming its model
BATCHSTREAM = "/v1/inference/advanced/batchstream"


async def _answered(receive: Receive, work: Coroutine[Any, Any, Reply], sent: bytes) -> Reply:
    """`work`'s reply, unless the client leaves first; passed on (PassedOn), it carries the
    body `sent` as it came: the process it goes to reads it again."""
    try:
        return await unless_gone(receive, work)
    except PassedOn as passed:
        passed.body = sent
        raise


def generate_target(path: str) -> tuple[str, str, str] | None:
    """The model, version and action (generate, generate_stream) a generate route names
    (`/v2/models/NAME[/versions/V]/generate[_stream]`); None: another route."""
    named = _model_action(path)
    return named if named is not None and named[2] in _GENERATE else None


def model_target(path: str) -> tuple[str, str] | None:
    """The model and version an infer or generate route names: what a front-end may serve
    itself; None: another route."""
    named = _model_action(path)
    if named is None or named[2] not in ("infer", *_GENERATE):
        return None
    return named[0], named[1]


def infer_target(path: str) -> tuple[str, str, str] | None:
    """The model and version an infer route names (`/v2/models/NAME[/versions/V]/infer`),
    with its template; None: another route."""
    named = _model_action(path)
    if named is None or named[2] != "infer":
        return None
    model, version, _ = named
    if version:
        return model, version, "/v2/models/{model}/versions/{version}/infer"
    return model, "", "/v2/models/{model}/infer"


def _model_action(path: str) -> tuple[str, str, str] | None:
    """The model, version ("": none named) and action of `/v2/models/NAME[/versions/V]/ACTION`;
    None: a path of another shape."""
    parts = path.strip("/").split("/")
    if len(parts) == 4 and parts[:2] == ["v2", "models"]:
        return parts[2], "", parts[3]
    if len(parts) == 6 and parts[:2] == ["v2", "models"] and parts[3] == "versions":
        return parts[2], parts[4], parts[5]
    return None


def _peer(scope: Scope) -> Peer:
    return rest_peer(scope.get("client"), scope.get("server"), scope.get("http_version", ""))


def _no_route(scope: Scope) -> Refused:
    return Refused(
        404, f"no route {errors.echoed(scope['path'])!r}", code=grpc.StatusCode.UNIMPLEMENTED
    )
