"""The models being served: the registry of their versions and finding the one a request
names. The lifecycle (service/lifecycle/) fills it; the request path (service/serving/) reads
it."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.batching.batcher import Batcher
from service.batching.concurrency import ConcurrencyLimit
from service.batching.sequence_batcher import SequenceBatcher
from service.inference import classification, errors
from service.inference.identity import Identity
from service.inference.jobs import OutputTensor
from service.inference.validation import RequestValidator
from service.model import ensemble
from service.model.decoupled import is_decoupled
from service.model.parameters import check_parameters
from service.registry.names import check_model_name, parse_version
from service.registry.statistics import ModelStats
from service.resilience.breaker import CircuitBreaker, Shown, worst
from service.workers.instance import WorkerInstance
from service.workers.slots import SLOTS_PER_WORKER
from service.workers.worker_process import State


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
    batcher: Batcher | None = None
    stats: ModelStats = field(default_factory=ModelStats)
    local_numa: int | None = None  # the front-end's NUMA node
    refused: bool = False  # by the signing policy: requests get FAILED_PRECONDITION
    fingerprint: tuple[tuple[str, int, int], ...] = ()  # the files it was loaded from
    copy: Path | None = None  # the verified private copy its workers load (signed models)
    active: int = 0  # requests that resolved to this version and are not answered yet
    breaker: CircuitBreaker = field(init=False)
    # With --frontends N: the breakers front-ends keep of it, as each last reported them.
    breakers_elsewhere: tuple[Shown, ...] = ()
    # With --frontends N: front-ends that may still hold requests of it in its workers (they
    # have not said they let it go): it winds down once none does.
    held_elsewhere: int = 0
    steps: tuple[ensemble.Step, ...] = ()  # an ensemble's; it has no instances of its own
    # A decoupled model's places for requests running at once (it has no batcher).
    generations: ConcurrencyLimit | None = None
    # A sequence model's batcher (it has no dynamic batcher).
    sequences: SequenceBatcher | None = None
    steps_ready: Callable[[], bool] | None = None  # an ensemble: whether all its steps are
    # Each output's labels (its label_filename's lines), for the classification extension.
    labels: Mapping[str, tuple[bytes, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The config was checked when it was read, so its parameters parse.
        self.breaker = CircuitBreaker(check_parameters(self.config).breaker)

    def classified(
        self, outputs: Sequence[OutputTensor], counts: Mapping[str, int]
    ) -> tuple[OutputTensor, ...]:
        """`outputs` with each one named in `counts` as its top k classes (Triton's
        classification extension), with this version's labels."""
        batched = self.config.max_batch_size > 0
        return classification.classified(outputs, counts, batched, self.labels)

    def shown_breaker(self) -> Shown:
        """The breaker state ListInstances and /metrics show: the worst of this process's
        and the front-ends' (`worst`)."""
        own = (self.breaker.state, self.breaker.retry_in_s())
        return worst((own, *self.breakers_elsewhere))

    @property
    def decoupled(self) -> bool:
        """Read from the config each time: the load replaces the config with its completed
        form, and a value kept from before could drift from it."""
        return is_decoupled(self.config)

    @property
    def ready(self) -> bool:
        if self.state is not VersionState.READY:
            return False
        if self.steps_ready is not None:
            return self.steps_ready()
        return any(i.state is State.READY for i in self.instances)

    def start_failure(self) -> str | None:
        """Why no instance can start, when none can (their restarts keep failing)."""
        failures = [i.start_failure for i in self.instances]
        if not failures or None in failures:
            return None
        return failures[0]

    def capacity(self) -> int:
        """Batches the ready instances can hold at once (one running, one queued each)."""
        return SLOTS_PER_WORKER * self.ready_instances()

    def ready_instances(self) -> int:
        return sum(i.state is State.READY for i in self.instances)

    def instance_capacity(self, index: int) -> int:
        """Batches one instance can hold at once (a sequence's requests wait for its own
        instance, restarting or not: it is bound to it)."""
        return 0 if self.instances[index].state is State.STOPPED else SLOTS_PER_WORKER

    def queue(self) -> Batcher | ConcurrencyLimit | SequenceBatcher | None:
        """What holds the version's waiting requests (for metrics and ListInstances)."""
        return self.batcher or self.generations or self.sequences


class ModelRegistry:
    """The registry of served versions: which version a request names, and what each model
    is serving or why it serves nothing."""

    def __init__(self, on_change: Callable[[], None]) -> None:
        self._watchers = [on_change]
        self._models: dict[str, dict[int, ServedVersion]] = {}
        self._failed: dict[str, str] = {}  # model-level failures (no version to attach them to)
        self._unloaded: set[str] = set()
        # Models not in memory that a request loads (--model-memory-budget): never loaded
        # yet, or evicted; each with the reason RepositoryIndex shows.
        self._evicted: dict[str, str] = {}
        # Replaced versions that still run live sequences (until they end, expire or the
        # version winds down).
        self._holding: dict[str, list[ServedVersion]] = {}
        self.loading_done = False
        # False while listeners are still starting: front-end processes start theirs after
        # the parent, and a server is ready only once every one accepts calls.
        self.accepting = True

    def changed(self) -> None:
        for watcher in self._watchers:
            watcher()

    def watch(self, on_change: Callable[[], None]) -> None:
        """Call `on_change` too whenever what the registry serves changes."""
        self._watchers.append(on_change)

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
        self._evicted.pop(name, None)
        self.changed()

    def fail_model(self, name: str, reason: str) -> None:
        """The model has nothing to serve, for this reason."""
        self._models.pop(name, None)
        self._unloaded.discard(name)
        self._evicted.pop(name, None)
        self._failed[name] = reason

    def offer(self, name: str, reason: str) -> None:
        """A model of the repository not loaded: a request for it loads it (on_demand); one
        unloaded by RepositoryModelUnload stays unloaded."""
        if name not in self._models and name not in self._failed and name not in self._unloaded:
            self._evicted.setdefault(name, reason)
            self.changed()

    def evict(self, name: str, reason: str) -> dict[int, ServedVersion]:
        """Out of memory until a request loads it again: new requests wait for that load.
        The versions it had."""
        versions = self._models.pop(name, {})
        self._evicted[name] = reason
        self.changed()
        return versions

    def on_demand(self, name: str) -> bool:
        """Whether a request for the model loads it first (never loaded, or evicted)."""
        return name in self._evicted

    def withdraw(self, name: str) -> dict[int, ServedVersion] | None:
        """Unload: new requests are refused from now on. The versions it had, if loaded."""
        if self._evicted.pop(name, None) is not None:
            self._unloaded.add(name)
            self.changed()
            return {}
        versions = self._models.pop(name, None)
        if versions is None or name in self._unloaded:
            return None
        self._unloaded.add(name)
        self.changed()
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
            if name in self._evicted:
                raise errors.unavailable(
                    f"model '{name}' is not loaded ({self._evicted[name]}); a gRPC inference "
                    "request loads it"
                )
            if name in self._failed:
                raise errors.unavailable(f"model '{name}' failed to load: {self._failed[name]}")
            raise unknown_model(f"'{name}'", f"served models: {sorted(self._models)}")
        # A loaded version whose workers are restarting still takes requests: they wait for
        # the restart (bounded), which ModelReady reports as not ready meanwhile.
        if number is None:
            ready = [v for v in versions.values() if v.state is VersionState.READY]
            if ready:
                return max(ready, key=lambda v: v.version)
            raise _not_ready(versions[max(versions)])
        served = versions.get(number)
        if served is None:
            raise unknown_model(
                f"'{name}' version {number}", f"served versions: {sorted(versions)}"
            )
        if served.state is not VersionState.READY:
            raise _not_ready(served)
        return served

    def hold_sequences(self, replaced: ServedVersion) -> None:
        """A replaced version's live sequences keep going to it."""
        if replaced.sequences is not None and replaced.sequences.live:
            self._holding.setdefault(replaced.name, []).append(replaced)

    def sequence_holder(
        self, served: ServedVersion, corrid: int | str, owner: Identity
    ) -> ServedVersion:
        """The version running `owner`'s live sequence of `served`'s model: `served` itself,
        another served version, or one replaced by a reload; `served` when none does (it then
        says why the sequence is unknown)."""
        if served.sequences is None or served.sequences.holds(corrid, owner):
            return served
        holding = [
            v
            for v in self._holding.get(served.name, [])
            if v.sequences is not None and v.sequences.live
        ]
        self._holding[served.name] = holding
        for version in [*self._models.get(served.name, {}).values(), *holding]:
            if version.sequences is not None and version.sequences.holds(corrid, owner):
                return version
        return served

    def versions_of(self, name: str) -> list[ServedVersion]:
        check_model_name(name)
        return sorted(self._models.get(name, {}).values(), key=lambda v: v.version)

    def all_versions(self) -> list[ServedVersion]:
        return [v for name in sorted(self._models) for v in self.versions_of(name)]

    @property
    def all_ready(self) -> bool:
        return (
            self.loading_done
            and self.accepting
            and not self._failed
            and all(v.ready for v in self.all_versions())
        )

    def ensemble_ready(self, served: ServedVersion, depth: int = 0) -> bool:
        """Every step's model has a ready version (the one it names, if it names one); a
        step's ensemble is asked the same, no deeper than MAX_ENSEMBLE_DEPTH (so that a
        step cycle not refused yet is not ready, rather than asked forever)."""
        if depth >= ensemble.MAX_ENSEMBLE_DEPTH:
            return False
        for step in served.steps:
            try:
                model = self.resolve(step.model, step.version)
            except errors.ServiceError:
                return False
            ready = self.ensemble_ready(model, depth + 1) if model.steps else model.ready
            if not ready:
                return False
        return True

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
        entries += [
            pb.RepositoryIndexResponse.ModelIndex(name=n, state="UNAVAILABLE", reason=r)
            for n, r in sorted(self._evicted.items())
        ]
        return entries


def unknown_model(named: str, detail: str) -> errors.ServiceError:
    """NOT_FOUND in Triton's words, which its clients compare ("Request for unknown model:
    'NAME' is not found", "... 'NAME' version N is not found"), then what is served."""
    return errors.not_found(f"Request for unknown model: {named} is not found; {detail}")


def _not_ready(served: ServedVersion) -> errors.ServiceError:
    detail = f": {served.reason}" if served.reason else ""
    message = (
        f"model '{served.name}' version {served.version} is {served.state.value.lower()}{detail}"
    )
    if served.refused:
        return errors.failed_precondition(message)
    return errors.unavailable(message)
