"""The request path of a decoupled model: a request goes through its version's breaker (there is
no fallback: another model would not answer the same stream of responses), waits for one of the
version's places (batching/concurrency.py), runs in one instance (the least busy ready one) and
yields its responses as the caller takes them. Closing the iterator (the caller went away)
cancels the request in the model; a worker that dies before the request's first response runs
it again elsewhere."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import grpc

from service.batching.batcher import CRASHES_TO_POISON
from service.inference import errors
from service.inference.errors import WorkerDied
from service.inference.jobs import InferJob, StreamAnswer, Timings
from service.registry.versions import ServedVersion
from service.serving.circuit import admit, open_circuit
from service.workers.instance import WorkerInstance
from service.workers.worker_process import State


class StreamObserver(Protocol):
    """Told what only the streaming path sees (metrics and tracing live elsewhere)."""

    def on_generation(self, model: str, delta: int) -> None: ...

    def on_stream_response(self, model: str, seconds: float, first: bool) -> None: ...

    def generation_span(self, model: str, request_id: str) -> AbstractContextManager[Any]: ...


async def responses(
    served: ServedVersion,
    job: InferJob,
    caller_id: str,
    parameters: str,
    deadline: float | None,
    client: str,
    observer: StreamObserver,
) -> AsyncGenerator[StreamAnswer, None]:
    """The request's responses, the last one final; ServiceError ends it otherwise. The
    caller closes the iterator (contextlib.aclosing) when it stops early. `client`: whom the
    request counts against for the fair share of the version's places."""
    breaker = served.breaker
    admission, failure = admit(served)
    if admission is None:
        raise open_circuit(served, failure)
    assert served.generations is not None
    code: grpc.StatusCode | None = None
    started = time.perf_counter_ns()
    served.active += 1  # before any await: a swap cannot retire it under this request
    count, finished = 0, False
    refused: str | None = None  # the status of the model's error response, if it sent one
    try:
        with observer.generation_span(served.name, caller_id) as span:
            async with served.generations.held(deadline, client):
                queue_ns = time.perf_counter_ns() - started
                observer.on_generation(served.name, 1)
                try:
                    last = started  # the first response's time includes the wait for a place
                    async for answer in _attempts(served, job, caller_id, parameters, deadline):
                        if answer.outputs:
                            now = time.perf_counter_ns()
                            observer.on_stream_response(served.name, (now - last) / 1e9, not count)
                            last, count = now, count + 1
                        finished = answer.final
                        if answer.error is not None:
                            refused = answer.status
                        yield answer
                finally:
                    observer.on_generation(served.name, -1)
                    if span is not None:
                        span.set_attribute("paddlequic.responses", count)
    except errors.ServiceError as exc:
        code = exc.code
        served.stats.record_failure(time.perf_counter_ns() - started)
        raise
    except BaseException:
        # Closed by its caller: after the final response that is the end of the request.
        if not finished:
            code = grpc.StatusCode.CANCELLED
            served.stats.record_failure(time.perf_counter_ns() - started)
            raise
        code = _ended(served, job, started, queue_ns, refused)
        raise
    else:
        code = _ended(served, job, started, queue_ns, refused)
    finally:
        served.active -= 1
        breaker.record(admission, code)


def _ended(
    served: ServedVersion, job: InferJob, started: int, queue_ns: int, refused: str | None
) -> grpc.StatusCode | None:
    """Record a request that got its final response; an error response from the model makes
    it a failure under that error's status (for the statistics and the breaker)."""
    elapsed = time.perf_counter_ns() - started
    if refused is not None:
        served.stats.record_failure(elapsed)
        return grpc.StatusCode[refused]
    served.stats.record_success(job.rows, elapsed, queue_ns, Timings(0, 0, 0))
    return None


async def _attempts(
    served: ServedVersion, job: InferJob, caller_id: str, parameters: str, deadline: float | None
) -> AsyncGenerator[StreamAnswer, None]:
    """Run the request in one instance; again in another (or the restarted one) when its
    worker died before any response, up to CRASHES_TO_POISON deaths it is blamed for (and as
    many that the server caused: a preloaded launcher's end)."""
    died: WorkerDied | None = None
    deaths = blamed = 0
    while blamed < CRASHES_TO_POISON and deaths < 2 * CRASHES_TO_POISON:
        instance = _pick(served)
        request = await instance.submit(job, caller_id, parameters)
        gap_s = instance.execution_timeout_s
        try:
            while (answer := await request.next(deadline, gap_s)) is not None:
                yield answer
            return
        except WorkerDied as exc:
            died = exc
            deaths += 1
            blamed += exc.running
        finally:
            request.close()
    assert died is not None
    raise errors.internal(
        f"suspected poison input: the workers of model '{served.name}' died "
        f"{deaths} times running this request before its first response "
        f"({died.message})"
    )


def _pick(served: ServedVersion) -> WorkerInstance:
    """The ready instance holding the fewest requests (a generation holds its instance for
    long, so the exact count matters more than for a batch), on the front-end's NUMA node when
    that ties."""
    ready = [i for i in served.instances if i.state is State.READY] or served.instances
    return min(ready, key=lambda i: (i.outstanding, i.numa_node != served.local_numa))
