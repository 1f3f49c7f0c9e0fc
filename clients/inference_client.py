"""A numpy-level client for the Open Inference Protocol: arrays in, arrays out.

`grpc://host:port` speaks gRPC over HTTP/2, `grpcs://host:port` over HTTP/2 with TLS (a server
started with --h2-tls), `h3://host:port` gRPC over HTTP/3 (QUIC, TLS 1.3), `auto://host:port`
HTTP/2 until the server's `alt-svc` advertises HTTP/3, then HTTP/3 where UDP gets through
(clients.auto_channel). With TLS, pass the CA
that signed the server's certificate (e.g. the development CA certs/ca.pem) and, for a server
that asks for one, a client certificate and key.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Mapping,
    Sequence,
)
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.generation import Chunk, chunks, generation_request
from clients.sequences import ClientSequence, SequenceParameters
from clients.streaming import StreamRequest, StreamResponse, stream_responses
from clients.targets import DEFAULT_PORT, open_channel, parse_url

# Re-exported: the arrays <-> messages helpers have always been importable from here.
from clients.tensors import Parameter
from clients.tensors import build_request as build_request
from clients.tensors import parse_response as parse_response
from clients.tickets import SessionTicketCache
from clients.trace_context import Metadata, with_trace_context
from clients.transport_policy import TransportPolicy
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc

_T = TypeVar("_T")
_P = ParamSpec("_P")


class AsyncInferenceClient:
    """Async client; `grpc://` and `grpcs://` use grpc.aio over HTTP/2, `h3://` the QUIC
    channel, `auto://` either (see `transport`). All drive the same generated stub. Create it
    inside the event loop that uses it."""

    def __init__(
        self,
        url: str = f"grpc://localhost:{DEFAULT_PORT}",
        ca_file: str | None = None,
        ticket_cache: SessionTicketCache | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
        metadata: Iterable[tuple[str, str]] = (),
        transport_policy: TransportPolicy | None = None,
    ) -> None:
        """`ticket_cache` (h3, auto) lets reconnects resume with 0-RTT. `client_cert` and
        `client_key` (PEM; the key may be in the certificate file) need TLS. `metadata` goes
        with every call, e.g. the header of a restricted protocol. `transport_policy` (auto):
        what was learned of the server's HTTP/3, shared by the clients given the same one."""
        self.target = parse_url(url)
        self._metadata: Metadata = tuple(metadata)
        self._channel = open_channel(
            self.target, ca_file, ticket_cache, client_cert, client_key, transport_policy
        )
        self.stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray[Any, Any]],
        outputs: Sequence[str] = (),
        version: str = "",
        timeout: float | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        """`parameters`: the request's (Triton's `priority`, `timeout`, `sequence_id`, ...;
        `sequence()` sets the sequence ones for you)."""
        request = build_request(model, inputs, outputs, version, parameters=parameters)
        response = await self.stub.ModelInfer(
            request, timeout=timeout, metadata=with_trace_context(self._metadata)
        )
        return parse_response(response)

    async def stream_infer(
        self,
        requests: Iterable[StreamRequest] | AsyncIterable[StreamRequest],
        timeout: float | None = None,
    ) -> AsyncGenerator[StreamResponse, None]:
        """One ModelStreamInfer call: the requests go out as `requests` yields them, their
        responses are yielded as they arrive (interleaved across requests: match them by
        `request_id`), until every request had its final response. Closing the iterator
        (`aclose()`, or leaving an `async for` early) cancels the call and the requests
        still running. `timeout` bounds the whole call."""
        call = self.stub.ModelStreamInfer(
            timeout=timeout, metadata=with_trace_context(self._metadata)
        )
        # Closed here, not when collected: leaving the caller's loop cancels the call at once.
        async with contextlib.aclosing(stream_responses(call, requests)) as responses:
            async for response in responses:
                yield response

    def sequence(
        self, model: str, sequence_id: int | str | None = None, version: str = ""
    ) -> ClientSequence[Coroutine[Any, Any, dict[str, np.ndarray[Any, Any]]]]:
        """A sequence of a sequence-batched model; its `infer` sends the sequence parameters
        (a random id unless one is given)."""
        return ClientSequence(self, model, SequenceParameters(sequence_id), version)

    async def generate(
        self,
        model: str,
        prompt: str,
        max_tokens: int,
        temperature: float | None = None,
        seed: int | None = None,
        version: str = "",
        timeout: float | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """Text as a generation model produces it (see clients.generation); raises
        GenerationError when the model or server failed the request."""
        request = generation_request(model, prompt, max_tokens, temperature, seed, version)
        responses = self.stream_infer([request], timeout)
        async with contextlib.aclosing(responses), contextlib.aclosing(chunks(responses)) as text:
            async for chunk in text:
                yield chunk

    async def metadata(self, model: str, version: str = "") -> pb.ModelMetadataResponse:
        request = pb.ModelMetadataRequest(name=model, version=version)
        response: pb.ModelMetadataResponse = await self.stub.ModelMetadata(
            request, metadata=self._metadata
        )
        return response

    async def index(self) -> list[pb.RepositoryIndexResponse.ModelIndex]:
        request = pb.RepositoryIndexRequest()
        return list((await self.stub.RepositoryIndex(request, metadata=self._metadata)).models)

    async def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        request = health_pb2.HealthCheckRequest(service=service)
        response = await self._health.Check(request, timeout=timeout, metadata=self._metadata)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    @property
    def connect_mode(self) -> str:
        """How the last HTTP/3 connection started (full, resumed, 0rtt-accepted, ...)."""
        return str(getattr(self._channel, "last_connect_mode", None) or "tcp")

    @property
    def transport(self) -> str:
        """What the next call uses: `h2` or `h3` (with `auto://`, it changes as it learns)."""
        return str(
            getattr(self._channel, "transport", "h3" if self.target.scheme == "h3" else "h2")
        )

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncInferenceClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def _pulled(items: Iterable[_T]) -> AsyncIterator[_T]:
    """A plain iterable as an async one, each item taken in a worker thread."""
    iterator = iter(items)
    end = object()
    while (item := await asyncio.to_thread(next, iterator, end)) is not end:
        yield item  # type: ignore[misc]


def _arguments_of(
    source: Callable[Concatenate[Any, _P], None],
) -> Callable[[Callable[..., None]], Callable[Concatenate[Any, _P], None]]:
    """Gives the decorated `__init__(self, *args, **kwargs)` the arguments of the `__init__`
    `source`, for type checkers and `help()` alike: the sync client's options are the async
    client's, declared once."""

    def typed(init: Callable[..., None]) -> Callable[Concatenate[Any, _P], None]:
        functools.update_wrapper(init, source, assigned=(), updated=())
        return init

    return typed


def _blocking(
    method: Callable[Concatenate[AsyncInferenceClient, _P], Coroutine[Any, Any, _T]],
) -> Callable[Concatenate[InferenceClient, _P], _T]:
    """The sync client's version of an async client's method: the same arguments, run on the
    client's event loop thread."""

    def run(client: InferenceClient, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return client._run(method(client._client, *args, **kwargs))

    functools.update_wrapper(run, method)
    return run


class InferenceClient:
    """Synchronous facade: the async client runs on a private event loop thread, so both
    transports behave the same and calls from any thread are safe."""

    @_arguments_of(AsyncInferenceClient.__init__)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """As `AsyncInferenceClient`."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

        async def create() -> AsyncInferenceClient:
            return AsyncInferenceClient(*args, **kwargs)

        self._client = self._run(create())
        self.target = self._client.target

    def _run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    infer = _blocking(AsyncInferenceClient.infer)

    def sequence(
        self, model: str, sequence_id: int | str | None = None, version: str = ""
    ) -> ClientSequence[dict[str, np.ndarray[Any, Any]]]:
        """As `AsyncInferenceClient.sequence`."""
        return ClientSequence(self, model, SequenceParameters(sequence_id), version)

    def stream_infer(
        self, requests: Iterable[StreamRequest], timeout: float | None = None
    ) -> Generator[StreamResponse, None, None]:
        """As `AsyncInferenceClient.stream_infer`; `requests` is read in a worker thread, so
        it may block (e.g. on a queue) without holding up the responses. Close the iterator
        (`close()`, or leave a for loop early) to cancel the call."""
        return self._iterate(self._client.stream_infer(_pulled(requests), timeout))

    def generate(
        self,
        model: str,
        prompt: str,
        max_tokens: int,
        temperature: float | None = None,
        seed: int | None = None,
        version: str = "",
        timeout: float | None = None,
    ) -> Generator[Chunk, None, None]:
        """As `AsyncInferenceClient.generate`."""
        return self._iterate(
            self._client.generate(model, prompt, max_tokens, temperature, seed, version, timeout)
        )

    def _iterate(self, items: AsyncGenerator[_T, None]) -> Generator[_T, None, None]:
        """An async generator of the client's loop as a plain one; closing it closes that."""
        end = object()
        steps: list[asyncio.Task[Any]] = []

        async def step() -> object:
            steps[:] = [task] if (task := asyncio.current_task()) else []
            return await anext(items, end)

        async def close() -> None:
            # A wait interrupted in this thread (Ctrl-C) leaves its step running on the loop:
            # it is cancelled and ends before the generator is closed.
            for running in steps:
                if not running.done():
                    running.cancel()
                    await asyncio.wait([running])
            await items.aclose()

        try:
            while (item := self._run(step())) is not end:
                yield item  # type: ignore[misc]
        finally:
            if self._loop.is_running():
                self._run(close())

    metadata = _blocking(AsyncInferenceClient.metadata)
    index = _blocking(AsyncInferenceClient.index)
    health = _blocking(AsyncInferenceClient.health)

    @property
    def connect_mode(self) -> str:
        return self._client.connect_mode

    @property
    def transport(self) -> str:
        return self._client.transport

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
