"""The request path below the servicer: a request for a version goes through its breaker, to
its fallback model while the breaker is open, then to its batcher (or an ensemble's steps),
and what happened is recorded in its statistics and told to the observer."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Protocol

import grpc

from service.inference import errors
from service.inference.calls import ROOT, CallChain
from service.inference.jobs import (
    Answer,
    InferJob,
    InputTensor,
    OutputTensor,
    StreamAnswer,
    Timings,
)
from service.inference.validation import decoded
from service.model import ensemble
from service.model.parameters import check_parameters
from service.registry.versions import ModelRegistry, ServedVersion
from service.resilience.breaker import Admission
from service.resilience.fallback import incompatibility
from service.serving import streaming
from service.serving.circuit import admit, open_circuit
from service.serving.ensemble import run as run_ensemble


class RequestObserver(streaming.StreamObserver, Protocol):
    """Told what only the request path sees (metrics and tracing live elsewhere)."""

    def on_request(self, model: str, elapsed_ns: int, answer: Answer) -> None: ...

    def on_fallback(self, model: str, fallback: str) -> None: ...

    def encode_span(self) -> AbstractContextManager[Any]: ...


class RequestRunner:
    """Runs validated requests on the versions of the registry."""

    def __init__(self, registry: ModelRegistry, observer: RequestObserver) -> None:
        self.registry = registry
        self.observer = observer
        # --model-memory-budget: loads a model not in memory, within a deadline (the
        # lifecycle sets it; service/lifecycle/budget.py).
        self.load_on_demand: Callable[[str, float | None], Awaitable[None]] | None = None

    async def resolve_loaded(
        self, name: str, version: str, deadline: float | None
    ) -> ServedVersion:
        """The version a request the server makes names (an ensemble's step, a BLS call),
        loaded first when it is not in memory."""
        if self.load_on_demand is not None and self.registry.on_demand(name):
            await self.load_on_demand(name, deadline)
        return self.registry.resolve(name, version)

    async def infer(
        self, served: ServedVersion, job: InferJob, deadline: float | None, depth: int = 0
    ) -> tuple[ServedVersion, Answer]:
        """Run the request on `served`, or on its fallback model while its breaker is open:
        the version that answered, and its answer. `depth`: the ensembles it runs inside."""
        answering, answer = self._start(served, job, deadline, depth)
        return answering, await answer

    def submit(
        self, served: ServedVersion, job: InferJob, deadline: float | None
    ) -> tuple[ServedVersion, asyncio.Future[Answer]]:
        """`infer` for a caller with no task of its own to wait in (a described call): the
        version that answers, and the future of its answer, whose done-callbacks run once the
        request is recorded (statistics, breaker, observer). Cancelling it abandons the
        request."""
        answering, answer = self._start(served, job, deadline, 0)
        return answering, asyncio.ensure_future(answer)

    def _start(
        self, served: ServedVersion, job: InferJob, deadline: float | None, depth: int
    ) -> tuple[ServedVersion, Awaitable[Answer]]:
        """The version that answers and its answer: queued already when its batcher alone
        runs it (a future: no task, no coroutine per request), else a coroutine to await."""
        if served.decoupled:
            raise errors.ServiceError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"ModelInfer RPC doesn't support models with decoupled transaction policy: "
                f"model '{served.name}' answers with a stream of responses; call "
                "ModelStreamInfer",
            )
        if job.sequence is not None and not job.sequence.start:
            served = self.registry.sequence_holder(served, job.sequence.corrid, job.sequence.owner)
        admission, failure = admit(served)
        if admission is None:
            fallback = self._fallback(served, failure)
            # A fallback's own breaker guards it too; a fallback has no fallback of its own.
            admission = fallback.breaker.admit()
            if admission is None:
                raise open_circuit(fallback, fallback.start_failure())
            self.observer.on_fallback(served.name, fallback.name)
            served = fallback
        if served.steps or served.sequences is not None:
            return served, self._recorded(served, admission, job, deadline, depth)
        return served, self._queued(served, admission, job, deadline)

    def encode_span(self) -> AbstractContextManager[Any]:
        return self.observer.encode_span()

    async def validated(
        self,
        served: ServedVersion,
        inputs: tuple[InputTensor, ...],
        outputs: tuple[str, ...],
        chain: CallChain,
    ) -> InferJob:
        """A request the server put together (an ensemble's step, a BLS call), checked by its
        model's validator as strictly as a caller's; a refusal counts as the model's failure.
        It carries on the chain of BLS calls of the request it serves."""
        try:
            if served.validator is None:
                raise errors.unavailable(f"model '{served.name}' is not ready")
            job = await decoded(served.validator.check(inputs, outputs))
        except errors.ServiceError:
            served.stats.record_failure(0)
            raise
        return job if chain == ROOT else replace(job, chain=chain)

    def stream(
        self,
        served: ServedVersion,
        job: InferJob,
        caller_id: str,
        parameters: str,
        deadline: float | None,
        client: str,
    ) -> AsyncGenerator[StreamAnswer, None]:
        """A decoupled model's responses to the request (service/serving/streaming.py)."""
        return streaming.responses(
            served, job, caller_id, parameters, deadline, client, self.observer
        )

    async def _recorded(
        self,
        served: ServedVersion,
        admission: Admission,
        job: InferJob,
        deadline: float | None,
        depth: int,
    ) -> Answer:
        """Run the request, telling the version's breaker how it ended for the caller."""
        code: grpc.StatusCode | None = None
        try:
            return await self._run(served, job, deadline, depth)
        except BaseException as exc:
            code = _code(exc)
            raise
        finally:
            served.breaker.record(admission, code)

    def _fallback(self, served: ServedVersion, failure: str | None) -> ServedVersion:
        """The ready version of the fallback model, or UNAVAILABLE saying the circuit is open."""
        name = check_parameters(served.config).fallback_model
        if name is None:
            raise open_circuit(served, failure)
        try:
            fallback = self.registry.resolve(name, "")
        except errors.ServiceError as exc:
            raise open_circuit(served, failure, f"its fallback model: {exc.message}") from None
        reason = incompatibility(served.config, fallback.config)
        if reason is not None:
            raise open_circuit(served, failure, f"its fallback model '{name}' {reason}")
        return fallback

    def _queued(
        self, served: ServedVersion, admission: Admission, job: InferJob, deadline: float | None
    ) -> asyncio.Future[Answer]:
        """The request in its version's batcher; recorded when its future is done."""
        assert served.batcher is not None
        started = time.perf_counter_ns()
        try:
            answer = served.batcher.enqueue(job, deadline)
        except BaseException as exc:
            served.stats.record_failure(time.perf_counter_ns() - started)
            served.breaker.record(admission, _code(exc))
            raise
        served.active += 1  # before any await: a swap cannot retire it under this request
        answer.add_done_callback(
            functools.partial(self._answered, served, admission, job.rows, started)
        )
        return answer

    def _answered(
        self,
        served: ServedVersion,
        admission: Admission,
        rows: int,
        started: int,
        answer: asyncio.Future[Answer],
    ) -> None:
        """A queued request ended: recorded as `_run` records the others, then told to its
        version's breaker."""
        served.active -= 1
        elapsed_ns = time.perf_counter_ns() - started
        error = answer.exception() if not answer.cancelled() else asyncio.CancelledError()
        if error is None:
            result = answer.result()
            served.stats.record_success(rows, elapsed_ns, result.queue_ns, result.timings)
            self.observer.on_request(served.name, elapsed_ns, result)
        else:
            served.stats.record_failure(elapsed_ns)
        served.breaker.record(admission, None if error is None else _code(error))

    async def _run(
        self, served: ServedVersion, job: InferJob, deadline: float | None, depth: int
    ) -> Answer:
        """An ensemble's or a sequence's request."""
        started = time.perf_counter_ns()
        served.active += 1  # before any await: a swap cannot retire it under this request
        try:
            if served.steps:
                answer = await self._run_ensemble(served, job, deadline, depth)
            else:
                assert served.sequences is not None
                answer = await served.sequences.submit(job, deadline)
        except BaseException:
            served.stats.record_failure(time.perf_counter_ns() - started)
            raise
        finally:
            served.active -= 1
        elapsed_ns = time.perf_counter_ns() - started
        served.stats.record_success(job.rows, elapsed_ns, answer.queue_ns, answer.timings)
        self.observer.on_request(served.name, elapsed_ns, answer)
        return answer

    async def _run_ensemble(
        self, served: ServedVersion, job: InferJob, deadline: float | None, depth: int
    ) -> Answer:
        """Run the ensemble's steps, each through self.infer (a step's ensemble one level
        deeper); deeper than MAX_ENSEMBLE_DEPTH only a step cycle not refused yet goes."""
        if depth >= ensemble.MAX_ENSEMBLE_DEPTH:
            raise errors.failed_precondition(
                f"ensemble '{served.name}' runs inside {depth} ensembles, more than ensembles "
                f"nest ({ensemble.MAX_ENSEMBLE_DEPTH} deep at most): do its steps form a cycle?"
            )
        queue_ns = 0

        async def run_step(
            step: ensemble.Step, inputs: tuple[InputTensor, ...], outputs: tuple[str, ...]
        ) -> tuple[OutputTensor, ...]:
            nonlocal queue_ns
            model = await self.resolve_loaded(step.model, step.version, deadline)
            step_job = await self.validated(model, inputs, outputs, job.chain)
            _, answer = await self.infer(model, step_job, deadline, depth + 1)
            queue_ns += answer.queue_ns
            return answer.outputs

        outputs = await run_ensemble(served.name, served.steps, job, run_step)
        return Answer(outputs, Timings(0, 0, 0), queue_ns, job.rows)


def _code(error: BaseException) -> grpc.StatusCode:
    """How a request that raised `error` ended for its caller, as its breaker counts it."""
    return error.code if isinstance(error, errors.ServiceError) else grpc.StatusCode.CANCELLED
