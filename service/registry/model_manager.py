"""The models being served: the registry of their versions, finding the one a request names,
routing it to an instance, and recording what happened."""

from __future__ import annotations

import contextlib
import enum
import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from opentelemetry.trace import SpanContext

from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.batching.assemble import Batch
from service.batching.batcher import DynamicBatcher
from service.inference import errors
from service.inference.jobs import Answer, InferJob, InferResult, InputTensor, OutputTensor, Timings
from service.inference.validation import RequestValidator, decoded
from service.model import ensemble
from service.model.parameters import check_parameters
from service.registry.names import check_model_name, parse_version
from service.registry.statistics import ModelStats
from service.resilience.breaker import Admission, BreakerState, CircuitBreaker
from service.resilience.fallback import incompatibility
from service.serving.ensemble import run as run_ensemble
from service.workers import routing
from service.workers.instance import State, WorkerInstance
from service.workers.slots import SLOTS_PER_WORKER


class VersionState(enum.Enum):
    UNAVAILABLE = "UNAVAILABLE"
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"


@dataclass
class ServedVersion:
    name: str
    version: int
    config: mc.ModelConfig
    state: VersionState = VersionState.LOADING
    reason: str = ""
    instances: list[WorkerInstance] = field(default_factory=list)
    validator: RequestValidator | None = None
    batcher: DynamicBatcher | None = None
    stats: ModelStats = field(default_factory=ModelStats)
    local_numa: int | None = None  # the front-end's NUMA node
    refused: bool = False  # by the signing policy: requests get FAILED_PRECONDITION
    fingerprint: tuple[tuple[str, int, int], ...] = ()  # the files it was loaded from
    copy: Path | None = None  # the verified private copy its workers load (signed models)
    active: int = 0  # requests that resolved to this version and are not answered yet
    breaker: CircuitBreaker = field(init=False)
    steps: tuple[ensemble.Step, ...] = ()  # an ensemble's; it has no instances of its own
    steps_ready: Callable[[], bool] | None = None  # an ensemble: whether all its steps are
    _random: random.Random = field(default_factory=lambda: random.Random(0))

    def __post_init__(self) -> None:
        # The config was checked when it was read, so its parameters parse.
        self.breaker = CircuitBreaker(check_parameters(self.config).breaker)

    @property
    def ready(self) -> bool:
        if self.state is not VersionState.READY:
            return False
        if self.steps_ready is not None:
            return self.steps_ready()
        return any(i.state is State.READY for i in self.instances)

    def pick_instance(self) -> WorkerInstance:
        ready = [i for i in self.instances if i.state is State.READY] or self.instances
        return routing.choose(ready, self.local_numa, self._random)

    def start_failure(self) -> str | None:
        """Why no instance can start, when none can (their restarts keep failing)."""
        failures = [i.start_failure for i in self.instances]
        if not failures or None in failures:
            return None
        return failures[0]

    def capacity(self) -> int:
        """Batches the ready instances can hold at once (one running, one queued each)."""
        return SLOTS_PER_WORKER * sum(i.state is State.READY for i in self.instances)


class ManagerObserver(Protocol):
    """Told what only the model manager sees (metrics and tracing live elsewhere)."""

    def on_request(self, model: str, elapsed_ns: int, answer: Answer) -> None: ...

    def on_batch(self, model: str, rows: int, timings: Timings) -> None: ...

    def batch_span(
        self, model: str, version: int, rows: int, requests: Sequence[SpanContext]
    ) -> AbstractContextManager[Any]: ...

    def encode_span(self) -> AbstractContextManager[Any]: ...

    def on_load_failure(self, model: str, reason: str) -> None: ...

    def on_fallback(self, model: str, fallback: str) -> None: ...


class ModelManager:
    """The registry of served versions and the request path: which version a request names,
        running it, and recording what happened. The lifecycle
    (service/lifecycle/lifecycle.py) fills the
        registry."""

    def __init__(self, on_change: Callable[[], None]) -> None:
        self._on_change = on_change
        self._models: dict[str, dict[int, ServedVersion]] = {}
        self._failed: dict[str, str] = {}  # model-level failures (no version to attach them to)
        self._unloaded: set[str] = set()
        self.loading_done = False
        self.observer: ManagerObserver | None = None

    def changed(self) -> None:
        self._on_change()

    def serving(self, name: str) -> dict[int, ServedVersion]:
        """The versions of a loaded model (none once unloaded)."""
        return {} if name in self._unloaded else dict(self._models.get(name, {}))

    def loaded_names(self) -> list[str]:
        return sorted(set(self._models) - self._unloaded)

    def publish(self, name: str, versions: dict[int, ServedVersion]) -> None:
        """These versions are the model's from now on."""
        self._models[name] = versions
        self._failed.pop(name, None)
        self._unloaded.discard(name)
        self._on_change()

    def fail(self, name: str, reason: str) -> None:
        """The model has nothing to serve, for this reason."""
        self._models.pop(name, None)
        self._unloaded.discard(name)
        self._failed[name] = reason

    def withdraw(self, name: str) -> dict[int, ServedVersion] | None:
        """Unload: new requests are refused from now on. The versions it had, if loaded."""
        versions = self._models.pop(name, None)
        if versions is None or name in self._unloaded:
            return None
        self._unloaded.add(name)
        self._on_change()
        return versions

    def resolve(self, name: str, version: str) -> ServedVersion:
        """The version a request names, or the newest ready one; errors say what exists."""
        check_model_name(name)
        number = parse_version(version)
        versions = self._models.get(name)
        if name in self._unloaded:
            raise errors.unavailable(
                f"model '{name}' was unloaded; load it again with RepositoryModelLoad"
            )
        if versions is None:
            if name in self._failed:
                raise errors.unavailable(f"model '{name}' failed to load: {self._failed[name]}")
            raise errors.not_found(f"unknown model '{name}'; served models: {sorted(self._models)}")
        # A loaded version whose workers are restarting still takes requests: they wait for
        # the restart (bounded), which ModelReady reports as not ready meanwhile.
        if name in self._unloaded:
            raise errors.unavailable(
                f"model '{name}' was unloaded; load it again with RepositoryModelLoad"
            )
        if number is None:
            ready = [v for v in versions.values() if v.state is VersionState.READY]
            if ready:
                return max(ready, key=lambda v: v.version)
            raise _not_ready(versions[max(versions)])
        served = versions.get(number)
        if served is None:
            raise errors.not_found(
                f"model '{name}' has no version {number}; served versions: {sorted(versions)}"
            )
        if served.state is not VersionState.READY:
            raise _not_ready(served)
        return served

    def versions_of(self, name: str) -> list[ServedVersion]:
        check_model_name(name)
        return sorted(self._models.get(name, {}).values(), key=lambda v: v.version)

    def all_versions(self) -> list[ServedVersion]:
        return [v for name in sorted(self._models) for v in self.versions_of(name)]

    @property
    def all_ready(self) -> bool:
        return self.loading_done and not self._failed and all(v.ready for v in self.all_versions())

    def index(self) -> list[pb.RepositoryIndexResponse.ModelIndex]:
        entries = [
            pb.RepositoryIndexResponse.ModelIndex(
                name=v.name, version=str(v.version), state=v.state.value, reason=v.reason
            )
            for v in self.all_versions()
        ]
        entries += [
            pb.RepositoryIndexResponse.ModelIndex(name=n, state="UNAVAILABLE", reason=r)
            for n, r in sorted(self._failed.items())
        ]
        entries += [
            pb.RepositoryIndexResponse.ModelIndex(name=n, state="UNAVAILABLE", reason="unloaded")
            for n in sorted(self._unloaded)
        ]
        return entries

    async def infer(
        self, served: ServedVersion, job: InferJob, deadline: float | None
    ) -> tuple[ServedVersion, Answer]:
        """Run the request on `served`, or on its fallback model while its breaker is open:
        the version that answered, and its answer."""
        breaker = served.breaker
        failure = served.start_failure()
        if failure is not None and breaker.state is BreakerState.CLOSED:
            breaker.trip()
        admission = breaker.admit()
        if admission is None:
            fallback = self._fallback(served, failure)
            # A fallback's own breaker guards it too; a fallback has no fallback of its own.
            fallback_admission = fallback.breaker.admit()
            if fallback_admission is None:
                raise _open_circuit(fallback, fallback.start_failure())
            if self.observer is not None:
                self.observer.on_fallback(served.name, fallback.name)
            return fallback, await self._recorded(fallback, fallback_admission, job, deadline)
        return served, await self._recorded(served, admission, job, deadline)

    async def _recorded(
        self,
        served: ServedVersion,
        admission: Admission,
        job: InferJob,
        deadline: float | None,
    ) -> Answer:
        """Run the request, telling the version's breaker how it ended for the caller."""
        code: grpc.StatusCode | None = None
        try:
            return await self._run(served, job, deadline)
        except errors.ServiceError as exc:
            code = exc.code
            raise
        except BaseException:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            served.breaker.record(admission, code)

    def _fallback(self, served: ServedVersion, failure: str | None) -> ServedVersion:
        """The ready version of the fallback model, or UNAVAILABLE saying the circuit is open."""
        name = check_parameters(served.config).fallback_model
        if name is None:
            raise _open_circuit(served, failure)
        try:
            fallback = self.resolve(name, "")
        except errors.ServiceError as exc:
            raise _open_circuit(served, failure, f"its fallback model: {exc.message}") from None
        reason = incompatibility(served.config, fallback.config)
        if reason is not None:
            raise _open_circuit(served, failure, f"its fallback model '{name}' {reason}")
        return fallback

    def check_fallbacks(self) -> None:
        """Fail every ready version whose fallback model is served but does not take its
        inputs or give its outputs (checked once both are loaded, whichever came first)."""
        for served in self.all_versions():
            name = check_parameters(served.config).fallback_model
            if name is None or served.state is not VersionState.READY:
                continue
            ready = [v for v in self.serving(name).values() if v.state is VersionState.READY]
            reason = next(
                (r for v in ready if (r := incompatibility(served.config, v.config))), None
            )
            if reason is not None:
                served.state = VersionState.UNAVAILABLE
                served.reason = f"fallback_model '{name}' {reason}"
                self.load_failed(served.name, "fallback")
        self._on_change()

    async def _run(self, served: ServedVersion, job: InferJob, deadline: float | None) -> Answer:
        started = time.perf_counter_ns()
        served.active += 1  # before any await: a swap cannot retire it under this request
        try:
            if served.steps:
                answer = await self._run_ensemble(served, job, deadline)
            else:
                assert served.batcher is not None
                answer = await served.batcher.submit(job, deadline)
        except BaseException:
            served.stats.record_failure(time.perf_counter_ns() - started)
            raise
        finally:
            served.active -= 1
        elapsed_ns = time.perf_counter_ns() - started
        served.stats.record_success(job.rows, elapsed_ns, answer.queue_ns, answer.timings)
        if self.observer is not None:
            self.observer.on_request(served.name, elapsed_ns, answer)
        return answer

    async def _run_ensemble(
        self, served: ServedVersion, job: InferJob, deadline: float | None
    ) -> Answer:
        queue_ns = 0

        async def run_step(
            step: ensemble.Step, inputs: tuple[InputTensor, ...], outputs: tuple[str, ...]
        ) -> tuple[OutputTensor, ...]:
            nonlocal queue_ns
            model = self.resolve(step.model, step.version)
            try:
                assert model.validator is not None
                step_job = await decoded(model.validator.check(inputs, outputs))
            except errors.ServiceError:
                model.stats.record_failure(0)
                raise
            _, answer = await self.infer(model, step_job, deadline)
            queue_ns += answer.queue_ns
            return answer.outputs

        outputs = await run_ensemble(served.name, served.steps, job, run_step)
        return Answer(outputs, Timings(0, 0, 0), queue_ns, job.rows)

    def ensemble_ready(self, served: ServedVersion) -> bool:
        """Every step's model has a ready version (the one it names, if it names one)."""
        for step in served.steps:
            try:
                if not self.resolve(step.model, step.version).ready:
                    return False
            except errors.ServiceError:
                return False
        return True

    def check_ensembles(self) -> None:
        """Fail every ensemble a served step model cannot run (a step model not loaded yet
        only keeps the ensemble not ready)."""
        for served in self.all_versions():
            if not served.steps or served.state is not VersionState.READY:
                continue
            for step in served.steps:
                try:
                    model = self.resolve(step.model, step.version)
                except errors.ServiceError:
                    continue
                reason = (
                    f"{step.describe()} is an ensemble itself; ensembles do not nest"
                    if model.steps
                    else ensemble.check_step(step, served.config, model.config)
                )
                if reason is not None:
                    served.state, served.reason = VersionState.UNAVAILABLE, reason
                    self.load_failed(served.name, "ensemble")
                    break
        self._on_change()

    async def run_batch(
        self,
        served: ServedVersion,
        batch: Batch,
        requests: Sequence[SpanContext],
        deadline: float | None,
    ) -> InferResult:
        """Statistics and metrics count the rows requests brought (the batch sizes formed);
        the engine runs `batch` padded to its bucket."""
        rows = batch.formed
        with (
            self.observer.batch_span(served.name, served.version, rows, requests)
            if self.observer is not None
            else contextlib.nullcontext()
        ):
            result = await served.pick_instance().infer(batch, deadline)
        served.stats.record_batch(rows, result.timings)
        if self.observer is not None:
            self.observer.on_batch(served.name, rows, result.timings)
        return result

    def encode_span(self) -> AbstractContextManager[Any]:
        return (
            self.observer.encode_span() if self.observer is not None else contextlib.nullcontext()
        )

    def load_failed(self, name: str, reason: str) -> None:
        if self.observer is not None:
            self.observer.on_load_failure(name, reason)


def _open_circuit(
    served: ServedVersion, failure: str | None, detail: str = ""
) -> errors.ServiceError:
    why = f"no instance can start ({failure})" if failure else "too many recent requests failed"
    message = (
        f"model '{served.name}' version {served.version} is open-circuited: {why}; it will be "
        f"retried in {served.breaker.retry_in_s():.1f} s"
    )
    return errors.unavailable(f"{message}; {detail}" if detail else message)


def _not_ready(served: ServedVersion) -> errors.ServiceError:
    detail = f": {served.reason}" if served.reason else ""
    message = (
        f"model '{served.name}' version {served.version} is {served.state.value.lower()}{detail}"
    )
    if served.refused:
        return errors.failed_precondition(message)
    return errors.unavailable(message)
