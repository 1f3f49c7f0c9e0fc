"""Where a version's batcher sends its batches: to one of the version's worker instances
(service/workers/routing.py chooses which), recording the batch in its statistics, metrics and
traces."""

from __future__ import annotations

import random
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from opentelemetry.trace import SpanContext

from service.batching.assemble import Batch
from service.inference.jobs import InferResult, Timings
from service.registry.versions import ServedVersion
from service.workers import routing
from service.workers.instance import WorkerInstance
from service.workers.worker_process import State


class BatchObserver(Protocol):
    """Told of every batch run (metrics and tracing live elsewhere)."""

    def on_batch(self, model: str, rows: int, timings: Timings) -> None: ...

    def on_generated(self, model: str) -> None: ...

    def on_sequences(self, model: str, event: str, count: int) -> None: ...

    def batch_span(
        self, model: str, version: int, rows: int, requests: Sequence[SpanContext]
    ) -> AbstractContextManager[Any]: ...

    def batch_ran(
        self, model: str, version: int, rows: int, requests: Sequence[SpanContext], spent_ns: int
    ) -> None: ...


class BatchRunner:
    """Runs one version's batches (service/batching/batcher.py's RunBatch)."""

    def __init__(self, served: ServedVersion, observer: BatchObserver) -> None:
        self._served = served
        self._observer = observer
        self._random = random.Random(0)

    async def __call__(
        self, batch: Batch, requests: Sequence[SpanContext], deadline: float | None
    ) -> InferResult:
        """Statistics and metrics count the rows requests brought (the batch sizes formed);
        the engine runs `batch` padded to its bucket."""
        return await self._on(self._pick_instance(batch), batch, requests, deadline)

    async def run_on(
        self,
        index: int,
        batch: Batch,
        requests: Sequence[SpanContext],
        deadline: float | None,
        worker: int | None,
    ) -> InferResult:
        """Run the batch on one instance, in one worker process if `worker` names it (a
        sequence's: service/batching/sequence_batcher.py)."""
        return await self._on(self._served.instances[index], batch, requests, deadline, worker)

    def worker_of(self, index: int) -> int:
        """The pid of an instance's worker process now."""
        return self._served.instances[index].pid

    async def _on(
        self,
        instance: WorkerInstance,
        batch: Batch,
        requests: Sequence[SpanContext],
        deadline: float | None,
        worker: int | None = None,
    ) -> InferResult:
        served, rows = self._served, batch.formed
        with self._observer.batch_span(served.name, served.version, rows, requests):
            result = await instance.infer(batch, deadline, worker)
        served.stats.record_batch(rows, result.timings)
        self._observer.on_batch(served.name, rows, result.timings)
        return result

    def _pick_instance(self, batch: Batch) -> WorkerInstance:
        instances = self._served.instances
        ready = [i for i in instances if i.state is State.READY] or instances
        if batch.chain.waiting:  # a BLS call's: never behind a batch that waits for it
            ready = [i for i in ready if not i.would_wait_for_itself(batch)] or ready
        return routing.choose(ready, self._served.local_numa, self._random, _outstanding)


def _outstanding(instance: WorkerInstance) -> int:
    """What the batcher weighs: every request the instance holds (front-ends' as they said)."""
    return instance.outstanding
