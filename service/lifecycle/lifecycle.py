"""The model lifecycle: the first load of every model, then loading, reloading and unloading
one, and failing a version (`Lifecycle.fail`, the one way a version fails). What it loads
goes into the registry (service/registry/versions.py), which the request path reads."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from google.protobuf import json_format, text_format

from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.inference import errors
from service.lifecycle.budget import BudgetObserver, MemoryBudget
from service.lifecycle.consistency import check_ensembles, check_fallbacks
from service.lifecycle.fingerprint import Fingerprint, fingerprint
from service.lifecycle.loading import VersionLoader, WorkerLimits, placement_key
from service.lifecycle.repository import ModelRepository, RepositoryError
from service.lifecycle.retiring import Retiring, wind_down
from service.lifecycle.signing import SigningPolicy
from service.lifecycle.uploads import (
    Refused,
    UploadLimits,
    plan_upload,
    remove_upload,
    write_upload,
)
from service.lifecycle.verified_copies import VerifiedCopies
from service.model.files import ENSEMBLE
from service.placement.instance_groups import instance_requests, place_all
from service.placement.topology import Topology
from service.registry.names import check_model_name
from service.registry.versions import ModelRegistry, ServedVersion, VersionState
from service.serving.batch_runner import BatchObserver
from service.serving.requests import RequestRunner
from service.workers import launch

log = logging.getLogger("paddlequic.models")


@dataclass(frozen=True)
class LifecycleOptions:
    """What the lifecycle reads of the server's options (the composition root fills it)."""

    model_control_mode: str  # none, poll or explicit
    poll_repository: float  # seconds between rescans (> 0: poll mode; 0: 5 s if polling)
    load_model: str  # explicit mode: the models loaded at start, comma-separated (* = all)
    testing_service: bool  # honour test-only model parameters
    workers: WorkerLimits = field(default_factory=WorkerLimits)
    uploads: UploadLimits = field(default_factory=UploadLimits)  # files sent with a load
    memory_budget_mb: int = 0  # --model-memory-budget (0: every model stays loaded)

    def __post_init__(self) -> None:
        mode = self.model_control_mode
        if mode not in ("none", "poll", "explicit"):
            raise RepositoryError(
                f"--model-control-mode must be none, poll or explicit, not {mode!r}"
            )


class LifecycleObserver(BatchObserver, BudgetObserver, Protocol):
    """Told of load failures, by stage, of every batch of the versions it loads, and of what
    the memory budget does."""

    def on_load_failure(self, model: str, reason: str) -> None: ...


class Lifecycle:
    """What changes the served models: the first load, then explicit or rescanned load /
    unload (service/lifecycle/watching.py decides when)."""

    def __init__(
        self,
        registry: ModelRegistry,
        runner: RequestRunner,
        repository: ModelRepository,
        topology: Topology,
        options: LifecycleOptions,
        observer: LifecycleObserver,
        signing: SigningPolicy | None = None,
    ) -> None:
        self.registry = registry
        self.repository = repository
        self.topology = topology
        self.observer = observer
        self.copies = VerifiedCopies(signing)
        self.loader = VersionLoader(
            registry,
            runner,
            topology,
            self.copies,
            observer,
            self.fail,
            options.testing_service,
            options.workers,
        )
        self.retiring = Retiring()
        self.uploads = options.uploads
        # Per model: the private directories of uploaded files its versions serve from.
        self._uploads: dict[str, list[Path]] = {}
        # Models whose last load had a config or files of their own.
        self._overridden: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        # The files a version last failed to load from, and that failed version.
        self._tried: dict[tuple[str, int], tuple[Fingerprint, ServedVersion]] = {}
        self.budget: MemoryBudget | None = None
        if options.memory_budget_mb > 0:
            self.budget = MemoryBudget(
                options.memory_budget_mb, registry, self.retiring.retire, self._lock, observer
            )
            self.budget.load = functools.partial(self._load, override=None, upload=None)
            runner.load_on_demand = self.budget.loaded

    async def fail(self, served: ServedVersion, reason: str, stage: str | None) -> None:
        """The version serves nothing, for `reason`: UNAVAILABLE at once (requests for it are
        refused from now on), counted as a load failure at `stage` (None: not counted, as
        for a failed warm-up), then what it holds finishes (bounded), its batcher and
        workers stop, its verified copy goes, and the change is signalled."""
        served.state, served.reason = VersionState.UNAVAILABLE, reason
        log.error("model %s version %d unavailable: %s", served.name, served.version, reason)
        if stage is not None:
            self.observer.on_load_failure(served.name, stage)
        await wind_down(served)
        self.registry.changed()

    async def stop(self) -> None:
        """Stop every version's batcher and workers."""
        if self.budget is not None:
            await self.budget.stop()
        await self.retiring.finish()
        versions = self.registry.all_versions()
        for served in versions:
            served.state = VersionState.UNLOADING
        await asyncio.gather(*(q.stop() for v in versions if (q := v.batcher or v.sequences)))
        await asyncio.gather(*(i.stop() for v in versions for i in v.instances))
        await launch.stop_launchers()
        for served in versions:
            served.state = VersionState.UNAVAILABLE
        self.copies.remove_all()
        for uploads in self._uploads.values():
            _remove_all(uploads)
        self._uploads.clear()

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
                    placement_key(name, f.version): instance_requests(
                        placement_key(name, f.version), model.config, self.topology
                    )
                    for f in model.versions
                    if model.config.platform != ENSEMBLE  # runs on its steps' instances
                }
                prints[name] = {f.version: fingerprint(f.path) for f in model.versions}
            except (RepositoryError, OSError, ValueError) as exc:
                self.registry.fail_model(name, str(exc))
                log.error("model %s not loaded: %s", name, exc)
                self.observer.on_load_failure(name, "repository")
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
                    model.name,
                    f.version,
                    model.config,
                    fingerprint=prints[model.name][f.version],
                    labels=model.labels,
                )
                for f in model.versions
            }
            self.registry.publish(model.name, versions)
            for files in model.versions:
                served = versions[files.version]
                key = placement_key(model.name, files.version)
                if model.config.platform == ENSEMBLE:
                    loads.append(self.loader.start_ensemble(served, files))
                elif key in unplaced:
                    await self.fail(served, unplaced[key], "placement")
                else:
                    loads.append(self.loader.start_placed(served, files, placements[key]))
        self.registry.changed()
        await asyncio.gather(*loads)
        await self._check_consistency()
        self.registry.loading_done = True
        self.registry.changed()

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def index(self) -> list[pb.RepositoryIndexResponse.ModelIndex]:
        """Every model of the repository, in every control mode, as Triton lists them: what
        the registry serves or why not, and each other model by its name alone (never
        loaded); sorted by name."""
        entries = self.registry.index()
        listed = {entry.name for entry in entries}
        try:
            names = await asyncio.to_thread(self.repository.model_names)
        except (RepositoryError, OSError):
            names = []  # a repository that went away: what the registry knows
        entries += [
            pb.RepositoryIndexResponse.ModelIndex(name=name) for name in names if name not in listed
        ]
        return sorted(entries, key=lambda entry: entry.name)

    async def _check_consistency(self) -> None:
        await check_ensembles(self.registry, self.fail)
        await check_fallbacks(self.registry, self.fail)

    async def load_model(
        self,
        name: str,
        config: str | None = None,
        files: Mapping[str, bytes] | None = None,
        explicit: bool = False,
    ) -> None:
        """Load a model, or reload it: versions that are new or whose files changed start in
        new workers and are warmed up, then take over in one step; the versions they replace
        finish what they hold, then stop. A version that fails to load leaves the one it would
        have replaced serving, and the error says why. `config` (JSON) replaces the model's
        config.pbtxt for this load; `files` (path -> bytes, with `config`) are the model's
        files, written to a fresh private directory that serves as its directory, as Triton's
        RepositoryModelLoad parameters do. `explicit` (RepositoryModelLoad): under a memory
        budget the model is pinned, never evicted."""
        check_model_name(name)
        failed = f"failed to load '{name}'"
        override = None if config is None else parse_config_override(config, failed)
        upload: Path | None = None
        if files:
            if override is None:
                raise errors.invalid(
                    f"{failed}: file: parameters (the model's files) need the `config` parameter"
                )
            plan = plan_upload({path: len(data) for path, data in files.items()}, self.uploads)
            if isinstance(plan, Refused):
                poll = f"{failed}, failed to poll from model repository: {plan.reason}"
                raise errors.internal(poll) if plan.too_large else errors.invalid(poll)
            try:
                upload = await asyncio.to_thread(
                    write_upload, name, plan, files, text_format.MessageToString(override)
                )
            except OSError as exc:
                raise errors.internal(
                    f"{failed}, failed to poll from model repository: the uploaded files "
                    f"cannot be written: {exc}"
                ) from exc
        elif not (self.repository.root / name).is_dir():
            raise errors.not_found(
                f"{failed}, failed to poll from model repository: the repository has no such model"
            )
        try:
            if self.budget is None:
                await self._load(name, override, upload)
            else:
                load = functools.partial(self._load, name, override, upload)
                await self.budget.loading(name, True if explicit else None, load)
        except BaseException:
            if upload is not None and upload not in self._uploads.get(name, ()):
                remove_upload(upload)
            raise

    def loaded_with_its_own(self, name: str) -> bool:
        """Whether the model's last load had a config or files of its own (a rescan leaves
        it as it is: its repository directory is not what serves)."""
        return name in self._overridden

    async def _load(self, name: str, override: mc.ModelConfig | None, upload: Path | None) -> None:
        """load_model's work, under the model's lock: from the repository, or from `upload`."""
        repository = self.repository if upload is None else ModelRepository(upload)
        async with self._lock(name):
            try:
                model = repository.load(name, override)
            except (RepositoryError, OSError) as exc:
                self._repository_failed(name, str(exc))
                raise errors.internal(
                    f"failed to load '{name}', failed to poll from model repository: {exc}"
                ) from exc
            # A load with a config or files of its own always starts new versions, and so does
            # the next load after it (its files were not the repository's).
            forced = override is not None or name in self._overridden
            if override is None:
                self._overridden.discard(name)
            else:
                self._overridden.add(name)
            current = self.registry.serving(name)
            result: dict[int, ServedVersion] = {}
            failures: list[ServedVersion] = []
            fresh: list[ServedVersion] = []  # the versions this load started
            for files in model.versions:
                old = current.get(files.version)
                try:
                    prints = await asyncio.to_thread(fingerprint, files.path)
                except OSError as exc:
                    raise errors.internal(
                        f"model '{name}' version {files.version} cannot be read: {exc}"
                    ) from exc
                unchanged = not forced and old is not None and old.fingerprint == prints
                if unchanged and old is not None and old.state is VersionState.READY:
                    result[files.version] = old
                    continue
                tried = None if forced else self._tried.get((name, files.version))
                if tried is not None and tried[0] == prints and old is not None:
                    # Failed before with these very files: not loaded again, and the load
                    # answers with the same failure (whatever serves goes on serving).
                    result[files.version] = old
                    failures.append(tried[1])
                    continue
                candidate = ServedVersion(
                    name, files.version, model.config, fingerprint=prints, labels=model.labels
                )
                await self.loader.start(candidate, files)
                fresh.append(candidate)
                if candidate.state is VersionState.READY:
                    self._tried.pop((name, files.version), None)
                    result[files.version] = candidate
                    continue
                self._tried[(name, files.version)] = (prints, candidate)
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
            self.registry.publish(name, result)
            await self._check_consistency()
            for version in retired:
                self.registry.hold_sequences(version)
            self.retiring.retire_soon(
                retired, "replaced", self._uploads_after(name, current, result, upload)
            )
            if failures:
                first = failures[0]
                message = f"load failed for model '{name}': version {first.version}: {first.reason}"
                raise (
                    errors.failed_precondition(message)
                    if first.refused
                    else errors.internal(message)
                )

    def _uploads_after(
        self,
        name: str,
        current: Mapping[int, ServedVersion],
        result: Mapping[int, ServedVersion],
        upload: Path | None,
    ) -> Callable[[], None] | None:
        """Which uploaded directories the model keeps once `result` is published: `upload`
        while a version this load started serves from it (else it goes now: those versions
        have stopped); the earlier ones until none of the versions they served is kept, then
        they go once those versions have wound down (what the answer says to do then)."""
        before = list(current.values())
        started = any(
            v.state is VersionState.READY and all(v is not old for old in before)
            for v in result.values()
        )
        if not started:
            if upload is not None:
                remove_upload(upload)
            return None
        kept = any(result.get(old.version) is old for old in before)
        earlier = self._uploads.pop(name, [])
        now = (earlier if kept else []) + ([upload] if upload is not None else [])
        if now:
            self._uploads[name] = now
        if kept or not earlier:
            return None
        return functools.partial(_remove_all, earlier)

    def _repository_failed(self, name: str, reason: str) -> None:
        """A reload that cannot read the model: what serves keeps serving, with the reason;
        a model with nothing serving is UNAVAILABLE with it."""
        serving = [v for v in self.registry.serving(name).values() if v.state is VersionState.READY]
        for version in serving:
            version.reason = f"kept serving: a reload failed: {reason}"
        if not serving:
            self.registry.fail_model(name, reason)
        self.observer.on_load_failure(name, "repository")
        self.registry.changed()

    async def unload_model(self, name: str) -> None:
        """Stop serving a model: new requests are refused at once; what its versions hold
        finishes; then their workers exit."""
        check_model_name(name)
        async with self._lock(name):
            versions = self.registry.withdraw(name)
            if versions is None:
                raise errors.not_found(f"model '{name}' is not loaded")
            if self.budget is not None:
                self.budget.forget(name)
            await asyncio.gather(*(self.retiring.retire(v, "unloaded") for v in versions.values()))
            _remove_all(self._uploads.pop(name, []))
            self._overridden.discard(name)


def parse_config_override(text: str, failed: str) -> mc.ModelConfig:
    """A load's `config` parameter: a ModelConfig in JSON, as Triton takes it."""
    try:
        return json_format.Parse(text, mc.ModelConfig())
    except json_format.ParseError as exc:
        raise errors.invalid(
            f"{failed}: the `config` parameter is not a ModelConfig in JSON: {exc}"
        ) from exc


def _remove_all(uploads: Sequence[Path]) -> None:
    for upload in uploads:
        remove_upload(upload)
