"""The closed loop: `concurrency` callers, each sending its next request as soon as the last
one answered, for a warm-up and then a measured window. Only requests that start and finish
inside the window count."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc.aio import EOF  # type: ignore[attr-defined]

from clients.streaming import is_final
from clients.targets import Target, open_channel
from clients.tickets import SessionTicketCache
from protos.inference import grpc_service_pb2 as pb

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
# How requests reach the server: one shared connection, or a new one per request (a full
# handshake each time, or resumed with 0-RTT from a session ticket: an edge device waking up).
CONNECT_MODES = ("reuse", "full", "0rtt")
STREAM_ERROR = "STREAM_ERROR"  # a ModelStreamInfer response carrying an error_message
# The server's CPU: its own process's, with --frontends N each front-end's, and its workers'.
_CPU_SECONDS = re.compile(
    rb"^(process_cpu_seconds_total|paddlequic_frontend_cpu_seconds_total"
    rb"|paddlequic_worker_cpu_seconds_total)(?:\{[^}]*\})? ([0-9.eE+-]+)$",
    re.M,
)
_WORKERS = b"paddlequic_worker_cpu_seconds_total"

# (phase, seconds into the phase, its length, requests so far, errors so far)
Progress = Callable[[str, float, float, int, int], None]


@dataclass(frozen=True)
class LoadSpec:
    target: Target
    request: bytes  # a serialized ModelInferRequest, sent as is every time
    warmup_s: float
    duration_s: float
    timeout_s: float
    streaming: bool = False
    decoupled: bool = False  # many responses per request: read each until its final one
    connect: str = "reuse"
    metadata: tuple[tuple[str, str], ...] = ()
    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    server_metrics: str = ""  # the server's /metrics URL, for its CPU time per request


@dataclass
class Step:
    """What one concurrency level measured."""

    concurrency: int
    connect: str
    window_s: float  # the measured window's length
    latencies_ns: list[int] = field(default_factory=list)  # successful requests
    errors: dict[str, int] = field(default_factory=dict)  # by status code name
    modes: dict[str, int] = field(default_factory=dict)  # how each connection started
    client_cpu_s: float = 0.0
    server_cpu_s: float | None = None
    worker_cpu_s: float | None = None  # the server's workers' (--server-metrics)
    # Decoupled models: of the successful requests in the window, the wait for the first data
    # response (time to first token) and the gaps between the next ones; and the data
    # responses (tokens) that arrived in the window, whatever request they belong to.
    first_token_ns: list[int] = field(default_factory=list)
    inter_token_ns: list[int] = field(default_factory=list)
    tokens: int = 0


class _Records:
    def __init__(self) -> None:
        # start, end, code, connect mode, when each data response arrived (decoupled)
        self.items: list[tuple[int, int, str, str, tuple[int, ...]]] = []
        self.errors = 0
        self.stopping = False

    def add(self, start: int, code: str, mode: str = "", tokens: tuple[int, ...] = ()) -> None:
        self.items.append((start, time.perf_counter_ns(), code, mode, tokens))
        self.errors += code != "OK"


async def run_step(spec: LoadSpec, concurrency: int, progress: Progress | None = None) -> Step:
    records = _Records()
    step = Step(concurrency, spec.connect, spec.duration_s)
    shared = None
    if spec.connect == "reuse":
        shared = open_channel(spec.target, spec.ca_file, None, spec.client_cert, spec.client_key)
    try:
        if shared is None:
            callers = [_connect_each(spec, records) for _ in range(concurrency)]
        elif spec.streaming:
            callers = [_streaming(spec, shared, records) for _ in range(concurrency)]
        else:
            callers = [_unary(spec, shared, records) for _ in range(concurrency)]
        tasks = [asyncio.ensure_future(c) for c in callers]
        window_start = await _clock(spec, step, records, progress)
        records.stopping = True
        await asyncio.gather(*tasks)
    finally:
        if shared is not None:
            await shared.close()
    window_end = window_start + int(spec.duration_s * 1e9)
    for began, ended, code, mode, tokens in records.items:
        # Tokens count where they arrived: a generation longer than the window still
        # streams in it.
        step.tokens += sum(window_start <= t <= window_end for t in tokens)
        if began < window_start or ended > window_end:
            continue
        if code == "OK":
            step.latencies_ns.append(ended - began)
            if tokens:
                step.first_token_ns.append(tokens[0] - began)
                step.inter_token_ns.extend(b - a for a, b in itertools.pairwise(tokens))
        else:
            step.errors[code] = step.errors.get(code, 0) + 1
        if mode:
            step.modes[mode] = step.modes.get(mode, 0) + 1
    return step


async def _clock(spec: LoadSpec, step: Step, records: _Records, progress: Progress | None) -> int:
    """Sleeps through the warm-up and the window, reporting progress, and measures the CPU
    both sides spend in the window; returns the window's start (perf_counter_ns)."""
    await _phase("warm-up", spec.warmup_s, records, progress)
    window_start = time.perf_counter_ns()
    cpu = time.process_time()
    server = await server_cpu(spec.server_metrics)
    await _phase("measuring", spec.duration_s, records, progress)
    step.client_cpu_s = time.process_time() - cpu
    after = await server_cpu(spec.server_metrics)
    if server is not None and after is not None:
        step.server_cpu_s = after.holding - server.holding
        # A worker restarted in the window started its count again: no figure then.
        workers = after.workers - server.workers
        step.worker_cpu_s = workers if workers >= 0 else None
    return window_start


async def _phase(name: str, length: float, records: _Records, progress: Progress | None) -> None:
    started = time.perf_counter()
    while (elapsed := time.perf_counter() - started) < length:
        if progress is not None:
            progress(name, elapsed, length, len(records.items), records.errors)
        await asyncio.sleep(min(0.25, length - elapsed))


@dataclass(frozen=True)
class ServerCpu:
    """CPU seconds, as the server's /metrics counts them."""

    holding: float  # of its processes that hold calls: the server process or parent, front-ends
    workers: float  # of its workers (a restarted one's from its restart)


async def server_cpu(url: str) -> ServerCpu | None:
    """The server's CPU seconds from its Prometheus endpoint (None without one)."""
    if not url:
        return None

    def scrape() -> bytes:
        with urllib.request.urlopen(url, timeout=5) as response:
            body: bytes = response.read()
            return body

    found = _CPU_SECONDS.findall(await asyncio.to_thread(scrape))
    if not found:
        return None
    workers = sum(float(value) for name, value in found if name == _WORKERS)
    holding = sum(float(value) for name, value in found if name != _WORKERS)
    return ServerCpu(holding, workers)


def _code(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    return type(exc).__name__


async def _unary(spec: LoadSpec, channel: Any, records: _Records) -> None:
    call = channel.unary_unary(INFER)  # no serializers: the request bytes go out as they are
    metadata = spec.metadata or None
    while not records.stopping:
        start = time.perf_counter_ns()
        try:
            await call(spec.request, timeout=spec.timeout_s, metadata=metadata)
            records.add(start, "OK")
        except (grpc.aio.AioRpcError, OSError) as exc:
            records.add(start, _code(exc))


async def _streaming(spec: LoadSpec, channel: Any, records: _Records) -> None:
    """One ModelStreamInfer stream per caller, one request in flight on it at a time; a
    stream that fails is counted and replaced."""
    metadata = spec.metadata or None
    while not records.stopping:
        stream = channel.stream_stream(STREAM_INFER)(metadata=metadata)
        try:
            await _stream_requests(spec, stream, records)
        except BaseException:
            stream.cancel()
            raise


async def _stream_requests(spec: LoadSpec, stream: Any, records: _Records) -> None:
    while not records.stopping:
        start = time.perf_counter_ns()
        try:
            await stream.write(spec.request)
            if spec.decoupled:
                code, tokens = await _generation(spec, stream)
                records.add(start, code, tokens=tokens)
                continue
            response = await asyncio.wait_for(stream.read(), spec.timeout_s)
        except _StreamEnded as ended:
            records.add(start, (await stream.code()).name, tokens=ended.tokens)
            return
        except (grpc.aio.AioRpcError, OSError, TimeoutError) as exc:
            records.add(start, _code(exc))
            return
        if response is EOF:
            records.add(start, (await stream.code()).name)
            return
        # error_message is field 1 and serializers write fields in order, so a response
        # with one starts with its tag (0x0a): no need to parse the outputs.
        records.add(start, STREAM_ERROR if response[:1] == b"\n" else "OK")
    # Half-close and let the server end the stream: it has nothing left to answer.
    try:
        await stream.done_writing()
        await asyncio.wait_for(stream.code(), spec.timeout_s)
    except (grpc.aio.AioRpcError, OSError, TimeoutError):
        stream.cancel()


class _StreamEnded(Exception):
    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens


async def _generation(spec: LoadSpec, stream: Any) -> tuple[str, tuple[int, ...]]:
    """Reads one decoupled request's responses up to its final one; returns the outcome and
    when each data response (one carrying outputs: a token) arrived."""
    tokens: list[int] = []
    while True:
        data = await asyncio.wait_for(stream.read(), spec.timeout_s)
        if data is EOF:
            raise _StreamEnded(tuple(tokens))
        # Parsed, but its outputs not decoded: the client's time goes to the transport.
        message = pb.ModelStreamInferResponse.FromString(data)
        final = is_final(message.infer_response)
        if message.error_message:
            if final:
                return STREAM_ERROR, tuple(tokens)
            continue
        if message.infer_response.outputs:
            tokens.append(time.perf_counter_ns())
        if final:
            return "OK", tuple(tokens)


async def _connect_each(spec: LoadSpec, records: _Records) -> None:
    """A new channel per request; with 0rtt, each caller keeps its own ticket cache so every
    connection after its first can resume (a ticket is single use). A connection closes in
    the background, as a device's would while it gets on with its work: QUIC's closing
    period (three probe timeouts) is no part of the next request."""
    tickets = SessionTicketCache() if spec.connect == "0rtt" else None
    metadata = spec.metadata or None
    plain = "tls" if spec.target.scheme == "grpcs" else "tcp"
    closing: set[asyncio.Task[None]] = set()
    try:
        while not records.stopping:
            start = time.perf_counter_ns()
            channel = open_channel(
                spec.target, spec.ca_file, tickets, spec.client_cert, spec.client_key
            )
            try:
                await channel.unary_unary(INFER)(
                    spec.request, timeout=spec.timeout_s, metadata=metadata
                )
                code = "OK"
            except (grpc.aio.AioRpcError, OSError) as exc:
                code = _code(exc)
            records.add(start, code, getattr(channel, "last_connect_mode", None) or plain)
            task = asyncio.ensure_future(channel.close())
            closing.add(task)
            task.add_done_callback(closing.discard)
    finally:
        await asyncio.gather(*closing, return_exceptions=True)
