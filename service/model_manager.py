"""The models being served: loading them into worker instances, finding the one a request
names, routing it to an instance, and recording what happened."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from opentelemetry.trace import SpanContext

from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service import errors
from service.batching.batcher import Answer, DynamicBatcher, policy_from_config
from service.batching.shapes import shape_buckets
from service.model_parameters import TESTING_CRASH_ON, check_parameters, string_parameters
from service.repository import (
    ModelFiles,
    ModelRepository,
    RepositoryError,
    check_model_name,
    complete_config,
    parse_version,
)
from service.scheduling import routing
from service.scheduling.instances import (
    frontend_numa_node,
    instance_requests,
    place_all,
    worker_environment,
)
from service.scheduling.placement import Placement
from service.scheduling.topology import Topology
from service.signing import SignatureError, SigningPolicy
from service.statistics import ModelStats
from service.tensors import BY_CONFIG_TYPE, config_type_name
from service.validation import InferJob, RequestValidator
from service.workers.instance import (
    SLOTS_PER_WORKER,
    InferResult,
    State,
    WorkerInstance,
    WorkerSpec,
)
from service.workers.protocol import Timings

log = logging.getLogger("paddlequic.models")
WARM_UP_TIMEOUT_S = 120.0
RETIRE_TIMEOUT_S = 60.0
# The watchdog's default limit per batch, where config.pbtxt sets no execution_timeout_ms:
# generous, so only a hung or stopped worker is killed, never a slow batch.
MIN_EXECUTION_TIMEOUT_S = 30.0
WARM_UP_MULTIPLE = 20


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
    active: int = 0  # requests that resolved to this version and are not answered yet
    _random: random.Random = field(default_factory=lambda: random.Random(0))

    @property
    def ready(self) -> bool:
        return self.state is VersionState.READY and any(
            i.state is State.READY for i in self.instances
        )

    def pick_instance(self) -> WorkerInstance:
        ready = [i for i in self.instances if i.state is State.READY] or self.instances
        return routing.choose(ready, self.local_numa, self._random)

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


class ModelManager:
    def __init__(
        self, repository: ModelRepository, topology: Topology, on_change: Callable[[], None]
    ) -> None:
        self.repository = repository
        self.topology = topology
        self._on_change = on_change
        self._models: dict[str, dict[int, ServedVersion]] = {}
        self._failed: dict[str, str] = {}  # model-level failures (no version to attach them to)
        self.loading_done = False
        self.observer: ManagerObserver | None = None
        self.signing: SigningPolicy | None = None
        self._unloaded: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._tried: dict[tuple[str, int], tuple[tuple[str, int, int], ...]] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        # --testing-service: honour test-only model parameters (a worker that crashes on cue).
        self.testing = False

    async def load_all(self, only: Sequence[str] | None = None) -> None:
        """Read every model (or those in `only`), place all their instances in one pass, then
        start them."""
        names = self.repository.model_names() if only is None else list(only)
        if not names:
            log.warning(
                "model repository %s holds no models; export the examples with `make models`",
                self.repository.root,
            )
        models, requests, prints = [], {}, {}
        for name in names:
            # Whatever goes wrong with one model (bad files, an I/O error, a bad parameter)
            # fails that model with a reason; it never stops the server.
            try:
                model = self.repository.load(name)
                model_requests = {
                    _key(name, f.version): instance_requests(
                        _key(name, f.version), model.config, self.topology
                    )
                    for f in model.versions
                }
                prints[name] = {f.version: fingerprint(f.path) for f in model.versions}
            except (RepositoryError, OSError, ValueError) as exc:
                self._failed[name] = str(exc)
                log.error("model %s not loaded: %s", name, exc)
                self._load_failed(name, "repository")
                continue
            models.append(model)
            requests.update(model_requests)
        try:
            placements, unplaced = place_all(requests, self.topology)
        except Exception as exc:  # a bug in placement must not take the other models down
            log.exception("placement failed")
            placements, unplaced = {}, {key: f"placement failed: {exc}" for key in requests}
        loads = []
        for model in models:
            versions = {
                f.version: ServedVersion(
                    model.name, f.version, model.config, fingerprint=prints[model.name][f.version]
                )
                for f in model.versions
            }
            self._models[model.name] = versions
            for files in model.versions:
                served, key = versions[files.version], _key(model.name, files.version)
                if key in unplaced:
                    served.state, served.reason = VersionState.UNAVAILABLE, unplaced[key]
                    log.error(
                        "model %s version %d not placed: %s",
                        model.name,
                        files.version,
                        unplaced[key],
                    )
                    self._load_failed(model.name, "placement")
                    continue
                loads.append(self._load_and_warm_up(served, files, placements[key]))
        self._on_change()
        await asyncio.gather(*loads)
        self.loading_done = True
        self._on_change()

    async def _load_and_warm_up(
        self, served: ServedVersion, files: ModelFiles, placements: list[Placement]
    ) -> None:
        """Load and warm up one version; any failure leaves it UNAVAILABLE with the reason."""
        try:
            await self._load_version(served, files, placements)
            if served.state is VersionState.READY:
                await self._warm_up(served)
        except Exception as exc:
            log.exception("model %s version %d failed to load", served.name, served.version)
            served.state, served.reason = VersionState.UNAVAILABLE, f"loading failed: {exc}"
            self._load_failed(served.name, "load")
            await asyncio.gather(*(i.stop() for i in served.instances), return_exceptions=True)
            self._on_change()

    async def _load_version(
        self, served: ServedVersion, files: ModelFiles, placements: list[Placement]
    ) -> None:
        config = served.config
        if self.signing is not None:
            try:
                await asyncio.to_thread(self.signing.check, files.path)
            except SignatureError as exc:
                served.state, served.reason, served.refused = (
                    VersionState.UNAVAILABLE,
                    f"signature refused: {exc}",
                    True,
                )
                log.error("model %s version %d refused: %s", served.name, served.version, exc)
                self._load_failed(served.name, "signature")
                self._on_change()
                return
        params = string_parameters(config)
        if not self.testing:
            params.pop(TESTING_CRASH_ON, None)
        limits = check_parameters(config)
        served.local_numa = frontend_numa_node(self.topology)
        simulated = self.topology.simulated
        served.instances = [
            WorkerInstance(
                WorkerSpec(
                    p.instance_name,
                    served.name,
                    files,
                    params,
                    device="gpu" if p.device == "gpu" and not simulated else "cpu",
                    env=worker_environment(p, params, p.device == "cpu" or simulated),
                    numa_node=p.numa_node,
                    label=_device_label(p, self.topology.simulated),
                    execution_timeout_s=limits.execution_timeout_s,
                    shapes=shape_buckets(config),
                )
            )
            for p in placements
        ]
        started = time.monotonic()
        results = await asyncio.gather(
            *(i.start() for i in served.instances), return_exceptions=True
        )
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        try:
            if failure is not None:
                raise RepositoryError(f"loading {files.path} failed: {failure}")
            loaded = results[0]
            assert not isinstance(loaded, BaseException)
            served.config = complete_config(config, loaded.inputs, loaded.outputs)
            served.validator = RequestValidator(served.config)
            served.batcher = DynamicBatcher(
                policy_from_config(served.config, len(served.instances)),
                lambda job, rows, requests, deadline: self._run_batch(
                    served, job, rows, requests, deadline
                ),
                served.capacity,
                f"model '{served.name}' version {served.version}",
            )
        except RepositoryError as exc:
            served.state, served.reason = VersionState.UNAVAILABLE, str(exc)
            log.error("model %s version %d not loaded: %s", served.name, served.version, exc)
            self._load_failed(served.name, "load")
            await asyncio.gather(*(i.stop() for i in served.instances))
            self._on_change()
            return
        served.state = VersionState.READY
        log.info(
            "loaded model %s version %d on %s in %.1f s: inputs %s -> outputs %s",
            served.name,
            served.version,
            ", ".join(f"{i.spec.instance_name} on {i.spec.label}" for i in served.instances),
            time.monotonic() - started,
            _describe(served.config.input, served.config.max_batch_size),
            _describe(served.config.output, served.config.max_batch_size),
        )
        self._on_change()

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
        self, served: ServedVersion, request: pb.ModelInferRequest, deadline: float | None
    ) -> Answer:
        started = time.perf_counter_ns()
        served.active += 1  # before any await: a swap cannot retire it under this request
        try:
            assert served.validator is not None and served.batcher is not None
            job = served.validator.validate(request)
            priority, timeout_s = request_scheduling(request)
            answer = await served.batcher.submit(job, deadline, priority, timeout_s)
        except BaseException:
            served.stats.record_failure(time.perf_counter_ns() - started)
            raise
        finally:
            served.active -= 1
        elapsed_ns = time.perf_counter_ns() - started
        served.stats.record_success(
            max(job.batch_size, 1), elapsed_ns, answer.queue_ns, answer.timings
        )
        if self.observer is not None:
            self.observer.on_request(served.name, elapsed_ns, answer)
        return answer

    async def _run_batch(
        self,
        served: ServedVersion,
        job: InferJob,
        rows: int,
        requests: Sequence[SpanContext],
        deadline: float | None,
    ) -> InferResult:
        """Statistics and metrics count `rows`, the rows requests brought (the batch sizes
        formed); the engine ran `job`, padded to its bucket."""
        with (
            self.observer.batch_span(served.name, served.version, rows, requests)
            if self.observer is not None
            else contextlib.nullcontext()
        ):
            result = await served.pick_instance().infer(job, deadline)
        served.stats.record_batch(rows, result.timings)
        if self.observer is not None:
            self.observer.on_batch(served.name, rows, result.timings)
        return result

    def encode_span(self) -> AbstractContextManager[Any]:
        return (
            self.observer.encode_span() if self.observer is not None else contextlib.nullcontext()
        )

    def _load_failed(self, name: str, reason: str) -> None:
        if self.observer is not None:
            self.observer.on_load_failure(name, reason)

    # lifecycle: load, reload and unload while serving

    async def load_model(self, name: str) -> None:
        """Load a model, or reload it: versions that are new or whose files changed start in
        new workers and are warmed up, then take over in one step; the versions they replace
        finish what they hold, then stop. A version that fails to load leaves the one it would
        have replaced serving, and the error says why."""
        check_model_name(name)
        if not (self.repository.root / name).is_dir():
            raise errors.not_found(f"model '{name}' not found in {self.repository.root}")
        async with self._locks.setdefault(name, asyncio.Lock()):
            try:
                model = self.repository.load(name)
            except (RepositoryError, OSError) as exc:
                self._repository_failed(name, str(exc))
                raise errors.internal(f"model '{name}' cannot be loaded: {exc}") from exc
            current = self._models.get(name, {}) if name not in self._unloaded else {}
            result: dict[int, ServedVersion] = {}
            failures: list[ServedVersion] = []
            for files in model.versions:
                old = current.get(files.version)
                try:
                    prints = await asyncio.to_thread(fingerprint, files.path)
                except OSError as exc:
                    raise errors.internal(
                        f"model '{name}' version {files.version} cannot be read: {exc}"
                    ) from exc
                unchanged = old is not None and old.fingerprint == prints
                if unchanged and old is not None and old.state is VersionState.READY:
                    result[files.version] = old
                    continue
                if self._tried.get((name, files.version)) == prints and old is not None:
                    # Failed before with these very files: not loaded again, still failing.
                    result[files.version] = old
                    if old.state is not VersionState.READY:
                        failures.append(old)
                    continue
                candidate = ServedVersion(name, files.version, model.config, fingerprint=prints)
                await self._start_version(candidate, files)
                if candidate.state is VersionState.READY:
                    self._tried.pop((name, files.version), None)
                    result[files.version] = candidate
                    continue
                self._tried[(name, files.version)] = prints
                failures.append(candidate)
                if old is not None and old.state is VersionState.READY:
                    old.reason = (
                        f"a new load failed, the loaded files still serve: {candidate.reason}"
                    )
                    result[files.version] = old
                else:
                    result[files.version] = candidate
            if failures and not any(v.state is VersionState.READY for v in result.values()):
                # Nothing new is ready: what served before goes on serving.
                for version in current.values():
                    if version.state is VersionState.READY and version.version not in result:
                        version.reason = f"kept serving: {failures[0].reason}"
                        result[version.version] = version
            retired = [v for v in current.values() if result.get(v.version) is not v]
            self._models[name] = result
            self._failed.pop(name, None)
            self._unloaded.discard(name)
            self._on_change()
            for version in retired:
                self._retire_soon(version, "replaced")
            if failures:
                first = failures[0]
                message = f"model '{name}' version {first.version}: {first.reason}"
                raise (
                    errors.failed_precondition(message)
                    if first.refused
                    else errors.internal(message)
                )

    def _repository_failed(self, name: str, reason: str) -> None:
        """A reload that cannot read the model: what serves keeps serving, with the reason;
        a model with nothing serving is UNAVAILABLE with it."""
        serving = [
            v
            for v in self._models.get(name, {}).values()
            if v.state is VersionState.READY and name not in self._unloaded
        ]
        for version in serving:
            version.reason = f"kept serving: a reload failed: {reason}"
        if not serving:
            self._models.pop(name, None)
            self._unloaded.discard(name)
            self._failed[name] = reason
        self._load_failed(name, "repository")
        self._on_change()

    async def unload_model(self, name: str) -> None:
        """Stop serving a model: new requests are refused at once; what its versions hold
        finishes; then their workers exit."""
        check_model_name(name)
        async with self._locks.setdefault(name, asyncio.Lock()):
            versions = self._models.pop(name, None)
            if versions is None or name in self._unloaded:
                raise errors.not_found(f"model '{name}' is not loaded")
            self._unloaded.add(name)
            self._on_change()
            await asyncio.gather(*(self._retire(v, "unloaded") for v in versions.values()))

    async def rescan(self, unload_missing: bool, only_loaded: bool) -> None:
        """Pick up what changed in the repository (SIGHUP, polling)."""
        try:
            names = set(self.repository.model_names())
        except (RepositoryError, OSError) as exc:
            log.error("rescan: %s", exc)  # the models already loaded keep serving
            return
        targets = sorted(set(self._models) - self._unloaded) if only_loaded else sorted(names)
        for name in targets:
            if name not in names:
                continue
            try:
                await self.load_model(name)
            except errors.ServiceError as exc:
                log.error("reload of %s: %s", name, exc.message)
        if unload_missing:
            for name in sorted(set(self._models) - names - self._unloaded):
                await self.unload_model(name)

    async def _start_version(self, served: ServedVersion, files: ModelFiles) -> None:
        key = _key(served.name, served.version)
        try:
            placements, unplaced = place_all(
                {key: instance_requests(key, served.config, self.topology)}, self.topology
            )
        except Exception as exc:  # a bug in placement must not take the other models down
            log.exception("placement of %s failed", key)
            placements, unplaced = {}, {key: f"placement failed: {exc}"}
        if key in unplaced:
            served.state, served.reason = VersionState.UNAVAILABLE, unplaced[key]
            return
        await self._load_and_warm_up(served, files, placements[key])

    async def _warm_up(self, served: ServedVersion) -> None:
        """One inference per declared input shape before the version takes traffic; its time
        sets the watchdog's limit where config.pbtxt sets none."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await self.infer(served, warm_up_request(served.config), started + WARM_UP_TIMEOUT_S)
        except errors.ServiceError as exc:
            served.state, served.reason = VersionState.UNAVAILABLE, f"warm-up failed: {exc.message}"
            await self._retire(served, served.reason)
            served.state = VersionState.UNAVAILABLE
            return
        timeout_s = max(MIN_EXECUTION_TIMEOUT_S, WARM_UP_MULTIPLE * (loop.time() - started))
        for instance in served.instances:
            if instance.execution_timeout_s is None:
                instance.execution_timeout_s = timeout_s
        served.stats = ModelStats()

    def _retire_soon(self, served: ServedVersion, why: str) -> None:
        task = asyncio.get_running_loop().create_task(self._retire(served, why))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, served: ServedVersion, why: str) -> None:
        """Let a version finish what it holds (bounded), then stop its workers."""
        if served.state is VersionState.READY:
            served.state = VersionState.UNLOADING
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETIRE_TIMEOUT_S
        batcher = served.batcher
        while loop.time() < deadline and (
            served.active or (batcher and (batcher.queued or batcher.in_flight_requests))
        ):
            await asyncio.sleep(0.01)
        if batcher is not None:
            await batcher.stop()
        await asyncio.gather(*(i.stop() for i in served.instances))
        if served.state is VersionState.UNLOADING:
            served.state, served.reason = VersionState.UNAVAILABLE, why
        log.info("model %s version %d %s; its workers stopped", served.name, served.version, why)

    async def stop(self) -> None:
        for task in list(self._retiring):
            await task
        for served in self.all_versions():
            served.state = VersionState.UNLOADING
        await asyncio.gather(*(v.batcher.stop() for v in self.all_versions() if v.batcher))
        await asyncio.gather(*(i.stop() for v in self.all_versions() for i in v.instances))
        for served in self.all_versions():
            served.state = VersionState.UNAVAILABLE


def request_scheduling(request: pb.ModelInferRequest) -> tuple[int | None, float | None]:
    """Triton's request parameters: `priority` (1 = highest) and `timeout` (microseconds)."""
    values: list[int | None] = []
    for key in ("priority", "timeout"):
        parameter = request.parameters.get(key)
        kind = parameter.WhichOneof("parameter_choice") if parameter is not None else None
        if kind not in ("int64_param", "uint64_param"):
            if kind is not None:
                raise errors.invalid(f"request parameter '{key}' must be an integer")
            values.append(None)
            continue
        value = int(getattr(parameter, kind))
        if value < 0:
            raise errors.invalid(f"request parameter '{key}' must not be negative")
        values.append(value)
    priority, timeout_us = values
    return priority, None if timeout_us is None else timeout_us / 1e6


def fingerprint(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """What identifies a version's files without reading them: path, size, mtime."""
    entries = []
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        stat = file.stat()
        entries.append((file.relative_to(directory).as_posix(), stat.st_size, stat.st_mtime_ns))
    return tuple(entries)


def warm_up_request(config: mc.ModelConfig) -> pb.ModelInferRequest:
    """Zeros for every input, batch 1, every variable dimension 1."""
    request = pb.ModelInferRequest(model_name=config.name, id="warm-up")
    batch = [1] if config.max_batch_size > 0 else []
    for tensor in config.input:
        datatype = BY_CONFIG_TYPE[tensor.data_type]
        shape = batch + [1 if d < 0 else d for d in tensor.dims]
        request.inputs.add(name=tensor.name, datatype=datatype.name, shape=shape)
        size = datatype.numpy.itemsize
        for dim in shape:
            size *= dim
        request.raw_input_contents.append(bytes(size))
    return request


def _key(name: str, version: int) -> str:
    return f"{name}_{version}"


def _device_label(placement: Placement, simulated: bool) -> str:
    if placement.device == "cpu":
        return f"cpu (NUMA {placement.numa_node})" if placement.numa_node >= 0 else "cpu"
    gpus = ",".join(str(i) for i in placement.gpu_indices)
    return f"gpu {gpus} (simulated: CPU predictor)" if simulated else f"gpu {gpus}"


def _not_ready(served: ServedVersion) -> errors.ServiceError:
    detail = f": {served.reason}" if served.reason else ""
    message = (
        f"model '{served.name}' version {served.version} is {served.state.value.lower()}{detail}"
    )
    if served.refused:
        return errors.failed_precondition(message)
    return errors.unavailable(message)


def _describe(tensors: object, max_batch_size: int) -> str:
    batch = [-1] if max_batch_size > 0 else []
    return ", ".join(
        f"{t.name}:{config_type_name(t.data_type).removeprefix('TYPE_')}{batch + list(t.dims)}"
        for t in tensors  # type: ignore[attr-defined]
    )
