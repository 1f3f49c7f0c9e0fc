"""A ModelInfer call a front-end serves itself (on a version it queues for itself:
shared_versions.py), as the parent serves a described call (described_call.py): observed,
access-checked and run by the same code, into a worker's queue and back, with no part for the
parent; its answer is the response message at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, Metric

from service.frontends.described_call import DescribedCall, Serving
from service.frontends.descriptors import DescribedAnswer, DescribedRequest
from service.frontends.model_view import response_message
from service.frontends.placed_here import PlacedTensors
from service.frontends.protocol import Kind, Open, Status, decode_status
from service.registry.versions import ServedVersion


class ServedHere:
    """The calls a front-end served itself, by transport (summed into the parent's /metrics
    with the rest of its metrics): beside paddlequic_frontend_calls_total, what it passed on,
    they show where ModelInfer calls go."""

    def __init__(self, registry: CollectorRegistry, frontend: int) -> None:
        self._calls = Counter(
            "paddlequic_frontend_served_calls",
            "ModelInfer calls (and REST infer and generate requests) a front-end process "
            "served itself, straight into the workers' queues or on its own socket to a "
            "decoupled model's worker (--frontend-queues), by the transport it got them on",
            ["frontend", "transport"],
            registry=registry,
        )
        self._stream_requests = Counter(
            "paddlequic_frontend_stream_requests",
            "ModelStreamInfer requests of the streams a front-end process held, by where they "
            "ran: here (straight into the workers' queues, or on its own socket to a "
            "decoupled model's worker) or parent (passed on in the stream's part)",
            ["frontend", "ran"],
            registry=registry,
        )
        self._frontend = str(frontend)
        registry.register(_ProcessCpu(self._frontend))

    def count(self, transport: str) -> None:
        self._calls.labels(self._frontend, transport).inc()

    def stream_request(self, here: bool) -> None:
        self._stream_requests.labels(self._frontend, "here" if here else "parent").inc()


class _ProcessCpu:
    """The front-end process's CPU time: /metrics' `process_*` families are the parent's, so
    without this the CPU of the calls served here would show nowhere (`paddlequic perf
    --server-metrics` adds it to the parent's)."""

    def __init__(self, frontend: str) -> None:
        self._frontend = frontend

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "paddlequic_frontend_cpu_seconds",
            "CPU time (user and system) of a front-end process; the parent's own is "
            "process_cpu_seconds_total",
            labels=["frontend"],
        )
        family.add_metric([self._frontend], time.process_time())
        yield family


async def serve_here(
    serving: Serving,
    opened: Open,
    described: DescribedRequest,
    served: ServedVersion,
    context: Any,
    placed: PlacedTensors | None = None,
) -> bytes:
    """The call's response message, or its status as `context.abort`. `placed`: where its
    tensors in shared-memory regions go (placed_here.py)."""
    link = _AnsweredHere()
    call = _ServedHere(link, 0, opened, served, described, serving)
    call.placed = placed
    call.start()
    try:
        data, status = await link.done
    except asyncio.CancelledError:  # the client left
        call.cancel()
        raise
    if status.code is not grpc.StatusCode.OK:
        await context.abort(status.code, status.details, status.trailing)
    return data


class _ServedHere(DescribedCall):
    """A described call this process serves itself: its answer is the response message."""

    def encode(self, answer: DescribedAnswer) -> bytes:
        return response_message(answer)


class _AnsweredHere:
    """The link of a call this process serves: its answer and status, when they come."""

    def __init__(self) -> None:
        self.done: asyncio.Future[tuple[bytes, Status]] = asyncio.get_running_loop().create_future()
        self._data = b""

    def send(self, kind: Kind, call_id: int, payload: bytes = b"") -> None:
        if kind is Kind.MESSAGE:
            self._data = payload
        elif kind is Kind.STATUS and not self.done.done():
            self.done.set_result((self._data, decode_status(payload)))

    def flush_large(self) -> None:
        pass

    def ended(self, call_id: int) -> None:
        pass
