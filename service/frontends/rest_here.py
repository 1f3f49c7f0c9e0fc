"""A front-end's REST app (`RestHere`): an infer or generate request on a version it serves
itself (shared_versions.py) is answered here by the parent's own routes (the same conversion,
checks, observation and request runner: InferRouter over a plane of this process's versions),
straight into the workers' queues or, a decoupled model's, on this process's own socket to its
worker, and so is a batchstream while this process serves every generation model (its lines
may name any, and none can be passed on); every other request goes to the parent
(rest_forward.py), whole, as does one whose
tensors name a shared-memory region this process holds no copy of (region_copies.py). A
request asking for classes is answered here: the view carries each version's labels."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager

import grpc

from service.dataplane.plane import InferencePlane, Resolved
from service.dataplane.shared_memory import SharedMemory
from service.frontends.model_view import ModelView
from service.frontends.rest_forward import RestForwarder
from service.frontends.served_here import ServedHere
from service.frontends.shared_versions import SharedVersions
from service.http.app import RestApp
from service.http.asgi import Message, Receive, Scope, Send
from service.http.infer_route import PassedOn
from service.http.observed import TRANSPORT
from service.http.router import BATCHSTREAM, COMPLETIONS, model_target
from service.http.textgen import generation_checked
from service.inference import errors
from service.inference.shared_memory import Caller
from service.registry.versions import ServedVersion
from service.serving.requests import RequestRunner


class FrontendPlane(InferencePlane):
    """The versions this process serves itself, and the shared-memory regions it holds copies
    of (region_copies.py)."""

    def __init__(
        self,
        runner: RequestRunner,
        view: ModelView,
        shared: SharedVersions,
        shared_memory: SharedMemory,
        batchstreams: bool,
    ) -> None:
        """`batchstreams`: whether it may serve batchstream (not under --model-memory-budget,
        where a line may name a model the parent loads first)."""
        super().__init__(runner, shared_memory)
        self._view = view
        self._shared = shared
        self._batchstreams = batchstreams

    def holds_regions(self, caller: Caller, names: Iterable[str]) -> bool:
        return self.shared_memory.regions.holds(caller, names)

    def here(self, model: str, version: str) -> ServedVersion | None:
        token = self._view.token(model, version)
        return None if token is None else self._shared.serving(token)

    def serving(
        self, name: str, version: str, deadline: float | None
    ) -> AbstractAsyncContextManager[ServedVersion]:
        return Resolved(self._here_or_passed(name, version))

    async def generation_model(self, name: str) -> ServedVersion:
        """The generation model a completion names, served here (else PassedOn: the parent
        answers it, loading it first under --model-memory-budget, or refuses it)."""
        return generation_checked(self._here_or_passed(name, ""), name)

    def serves_batchstream(self) -> bool:
        """A batchstream's lines may name any generation model: it is served here only when
        every one the parent serves is served here."""
        names = self._view.generation
        return self._batchstreams and bool(names) and all(self.here(n, "") for n in names)

    def generation_names(self) -> tuple[str, ...]:
        return self._view.generation

    async def streamed_generation_model(self, name: str) -> ServedVersion:
        """The generation model a batchstream line names: no line can be passed on, so a
        model not served here is refused (UNAVAILABLE while the parent serves it: this process
        takes it up or lets it go; NOT_FOUND for a name that is no generation model)."""
        served = self.here(name, "")
        if served is not None:
            return generation_checked(served, name)
        names = self._view.generation
        if name in names:
            raise errors.unavailable(
                f"model '{errors.echoed(name)}' is not served by this process at the moment; "
                "send the request again"
            )
        raise errors.ServiceError(
            grpc.StatusCode.NOT_FOUND,
            f"model '{errors.echoed(name)}' is not a generation model of this server (it "
            f"serves {list(names)}); GET /v1/models lists them",
        )

    def _here_or_passed(self, name: str, version: str) -> ServedVersion:
        served = self.here(name, version)
        if served is None:  # not served here, or let go since the request was routed here
            raise PassedOn(f"model '{name}' is not served by this process")
        return served


class RestHere:
    def __init__(
        self,
        app: RestApp,
        plane: FrontendPlane,
        forwarder: RestForwarder,
        served_here: ServedHere | None,
    ) -> None:
        """`app`: the infer route alone (InferRouter) over `plane`; `forwarder`: to the
        parent; `served_here`: what counts the calls served here (None: --no-metrics)."""
        self._app = app
        self._plane = plane
        self._forwarder = forwarder
        self._served_here = served_here

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._forwarder(scope, receive, send)
            return
        path = scope["path"]
        target = model_target(path)
        posted = scope["method"] == "POST"
        # A completion names its model in its body: read here, passed on if it is not here's.
        here = posted and (
            self._plane.here(*target)
            if target is not None
            else path in COMPLETIONS or (path == BATCHSTREAM and self._plane.serves_batchstream())
        )
        if not here:
            with self._app.holding(passed_on=True):
                if not self._app.busy():
                    await self._forwarder(scope, receive, send)
                    return
            # Past the host's REST limit: the app refuses it before it routes it (429).
        try:
            await self._app(scope, receive, send)
        except PassedOn as passed:
            replayed = receive if passed.body is None else _replayed(passed.body, receive)
            with self._app.holding(passed_on=True):
                await self._forwarder(scope, replayed, send)
            return
        if self._served_here is not None:
            self._served_here.count(TRANSPORT)


def _replayed(body: bytes, receive: Receive) -> Receive:
    """The request's body read here, given again whole to the forwarder; then the request's
    own messages (its client leaving)."""
    first: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def again() -> Message:
        return first.pop() if first else await receive()

    return again
