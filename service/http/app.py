"""The REST API as a plain ASGI application: a request is admitted (at most
--max-concurrent-rpcs at once), routed (router.py) and answered with its route's reply, a
route's failure as Triton's `{"error": ...}` with its HTTP status, and counted and logged as
every gRPC call is."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import grpc
from opentelemetry import context as otel_context

from service.http.asgi import Receive, Scope, Send, lifespan
from service.http.body_budget import BodyBudget
from service.http.bounds import HEADER_LENGTH, Refused, hold_answer
from service.http.callers import rest_client, rest_identity
from service.http.encoding import deflated
from service.http.event_stream import SSE, relay
from service.http.infer_route import PassedOn
from service.http.json_outputs import dumps
from service.http.observed import TRANSPORT, Call
from service.http.openai import error_document
from service.http.reply import Reply
from service.http.router import InferRouter
from service.http.status import RETRY_AFTER_S, error_status
from service.inference import errors
from transport.host_tally import ScopedTally

_JSON = (b"content-type", b"application/json")


class RestApp:
    def __init__(self, router: InferRouter) -> None:
        """`router`: every route (Router), or the infer route alone (a front-end's: any other
        request raises PassedOn, which whoever called the app answers)."""
        self.router = router
        self.limits = router.limits
        self.observer = router.observer
        self.in_flight = 0  # requests being handled, their bodies' reading included
        # With --frontends N, a front-end's: the requests it passes on to the parent (not
        # handled here, but held by this process), and where the front-ends count theirs.
        self.passed_on = 0
        self.host: ScopedTally | None = None
        self.budget = BodyBudget(self.limits.receive_budget, self.limits.receive_budget_per_address)
        self._draining: set[asyncio.Task[None]] = set()  # refused requests' bodies (_unread)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        call = Call(identity=rest_identity(scope), started=time.perf_counter())
        call.client = rest_client(scope, call.identity)
        try:
            await self._answer(scope, receive, send, call)
        except PassedOn:
            # Neither answered nor counted here: the process that serves it counts it.
            call.recorded = True
            if call.observation is not None:
                call.observation.abandon()
                call.observation = None
            raise
        except asyncio.CancelledError:
            call.code, call.error = grpc.StatusCode.CANCELLED, "the request was cancelled"
            raise
        except Exception as exc:
            call.code, call.error = grpc.StatusCode.INTERNAL, repr(exc)
            raise
        finally:
            self._ended(call)
            if call.trace is not None:
                otel_context.detach(call.trace)

    def _ended(self, call: Call) -> None:
        """The call counted and logged, once: before its response's last bytes are sent, so
        that a client that has its answer finds it in /metrics; else as it ends."""
        if call.recorded:
            return
        call.recorded = True
        observation = call.observation
        if observation is not None:
            observation.model, observation.version = call.model, call.version
            observation.request_id = call.request_id
            observation.end(call.code, lambda: call.error)
        elif self.observer is not None:
            self._record(call, time.perf_counter() - call.started)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        try:
            with self.holding():
                reply = await self._admitted(scope, receive, call)
        except Refused as exc:
            reply = self._refused(scope, call, exc)
            if exc.close:
                self._unread(receive)
        except errors.ServiceError as exc:
            status = error_status(exc)
            reply = Reply(status, _error(scope, status, exc.message, exc))
            call.code, call.error = exc.code, exc.message
        call.request_id = reply.request_id
        call.version = reply.model_version or call.version
        if reply.events is not None:
            await self._start(send, call, 200, list(SSE))
            await relay(
                reply.events,
                send,
                reply.gone or receive,
                call,
                self.limits.stall_s,
                lambda: self._ended(call),
            )
            return
        body, headers = await self._encoded(reply, call)
        status = reply.status
        del reply  # its outputs, encoded: not held while the answer is sent
        charge = call.charge
        if charge is not None and status == 200:
            # The answer holds the budget its body held until its client has taken it all: a
            # client that reads nothing holds it --http-send-timeout at most (listener.py).
            try:
                hold_answer(charge, len(body))
            except Refused as exc:
                refusal = self._refused(scope, call, exc)
                status = refusal.status
                body, headers = await self._encoded(refusal, call)
        try:
            await self._start(send, call, status, headers)
            self._ended(call)
            await send({"type": "http.response.body", "body": body})
        finally:
            if charge is not None:
                charge.release()

    @staticmethod
    def _refused(scope: Scope, call: Call, exc: Refused) -> Reply:
        call.code, call.error = exc.code, exc.message
        close = exc.close and scope.get("http_version") in ("1.0", "1.1")
        return Reply(exc.status, _error(scope, exc.status, exc.message, exc), close=close)

    @staticmethod
    async def _encoded(reply: Reply, call: Call) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        """The reply's body and headers as sent."""
        headers: list[tuple[bytes, bytes]] = []
        if reply.close:
            headers.append((b"connection", b"close"))
        if reply.status == 429:
            headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
        body = b"" if reply.document is None else dumps(reply.document)
        if reply.binary:
            headers.append((b"content-type", b"application/octet-stream"))
            headers.append((HEADER_LENGTH, str(len(body)).encode()))
            body = b"".join((body, *reply.binary))
        elif reply.document is not None:
            headers.append(_JSON)
        if call.encoding is not None and reply.status == 200:
            body = await deflated(body, call.encoding)
            headers.append((b"content-encoding", call.encoding.encode()))
        headers.append((b"content-length", str(len(body)).encode()))
        return body, headers

    def _unread(self, receive: Receive) -> None:
        """A refused request's body, left unread, taken and dropped until its stream ends.
        hypercorn queues a body for the application (10 messages), and once the queue is full
        it stops reading the connection; after the answer it puts the stream's end in the same
        queue: with nobody taking, that wait never ended, and neither did the connection (a
        request left waiting for the receive budget and then refused 429 held its connection
        and a stalled client for good). What is taken is dropped, within the lingering close's
        bounds once hypercorn closes the connection (lingering.py)."""
        task = asyncio.get_running_loop().create_task(_drop_until_end(receive))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    @staticmethod
    async def _start(
        send: Send, call: Call, status: int, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """The response's start, its status on the request's span."""
        span = call.observation.span if call.observation is not None else None
        if span is not None:
            span.set_attribute("http.response.status_code", status)
        await send({"type": "http.response.start", "status": status, "headers": headers})

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

    def share_host(self, requests: ScopedTally, bodies: ScopedTally) -> None:
        """With --frontends N: --max-concurrent-rpcs and the receive budget held for the host,
        every front-end's requests counted (service/frontends/host_limits.py)."""
        self.host = requests
        self.budget = BodyBudget(
            self.limits.receive_budget, self.limits.receive_budget_per_address, bodies
        )

    def busy(self) -> bool:
        """Past --max-concurrent-rpcs, the request asking counted: this process's requests
        and, with front-ends, every other front-end's."""
        held = self.in_flight + self.passed_on
        if self.host is not None:
            held += self.host.others(0)
        return held > self.limits.max_requests

    @contextlib.contextmanager
    def holding(self, passed_on: bool = False) -> Iterator[None]:
        """A request counted while this process holds it (`passed_on`: to another)."""
        if passed_on:
            self.passed_on += 1
        else:
            self.in_flight += 1
        self._publish()
        try:
            yield
        finally:
            if passed_on:
                self.passed_on -= 1
            else:
                self.in_flight -= 1
            self._publish()

    def _publish(self) -> None:
        if self.host is not None:
            self.host.set(0, self.in_flight + self.passed_on)

    async def _admitted(self, scope: Scope, receive: Receive, call: Call) -> Reply:
        """The route's reply, unless the server already handles as many REST requests as it
        may (refused before the body is read, which the refusal's connection closes on)."""
        if self.busy():
            raise Refused(
                429,
                f"the server handles at most {self.limits.max_requests} REST requests at once "
                "(--max-concurrent-rpcs); try again",
                close=True,
                code=grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        client = scope.get("client")
        call.charge = self.budget.charge(str(client[0]) if client else "")
        try:
            return await self.router.route(scope, receive, call)
        finally:
            call.charge.release()


async def _drop_until_end(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _error(scope: Scope, status: int, message: str, exc: Exception) -> Any:
    """The error body in the words of the route's API: OpenAI's under /v1, Triton's else."""
    if scope["path"].startswith("/v1/"):
        return error_document(status, message, exc)
    return {"error": message}
