"""The model lifecycle: load, reload, unload and retire versions, warm them up, rescan the
repository (SIGHUP, polling, per control mode). What it loads goes into the model manager's
registry, which serves the requests."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from oip.datatypes import BY_CONFIG_TYPE, config_type_name
from protos.inference import model_config_pb2 as mc
from service.batching.batcher import DynamicBatcher, policy_from_config
from service.inference import errors
from service.inference.validation import RequestValidator
from service.lifecycle.repository import (
    ModelRepository,
    RepositoryError,
    complete_config,
    fetch_names,
    read_config,
)
from service.lifecycle.signing import CONFIG_FILE, SIGNATURE_FILE, SignatureError, SigningPolicy
from service.lifecycle.warmup import WarmUpError, warm_ups
from service.model import ensemble
from service.model.files import ENSEMBLE, ModelFiles
from service.model.parameters import TESTING_CRASH_ON, check_parameters, string_parameters
from service.model.shapes import shape_buckets
from service.placement.instance_groups import (
    frontend_numa_node,
    instance_requests,
    place_all,
    worker_environment,
)
from service.placement.policy import Placement
from service.placement.topology import Topology
from service.registry.model_manager import ModelManager, ServedVersion, VersionState
from service.registry.names import check_model_name
from service.registry.statistics import ModelStats
from service.settings import ServerSettings
from service.workers.instance import WorkerInstance
from service.workers.spec import WorkerSpec

log = logging.getLogger("paddlequic.models")
WARM_UP_TIMEOUT_S = 120.0
RETIRE_TIMEOUT_S = 60.0
# The watchdog's default limit per batch, where config.pbtxt sets no execution_timeout_ms:
# generous, so only a hung or stopped worker is killed, never a slow batch.
MIN_EXECUTION_TIMEOUT_S = 30.0
WARM_UP_MULTIPLE = 20

Fingerprint = tuple[tuple[str, int, int], ...]


class Lifecycle:
    """What changes the served models: the first load, then SIGHUP rescans, polling and
    explicit load / unload, per control mode."""

    def __init__(
        self,
        models: ModelManager,
        repository: ModelRepository,
        topology: Topology,
        settings: ServerSettings,
    ) -> None:
        mode = settings.model_control_mode
        if mode not in ("none", "poll", "explicit"):
            raise RepositoryError(
                f"--model-control-mode must be none, poll or explicit, not {mode!r}"
            )
        if settings.poll_repository > 0 and mode == "none":
            mode = "poll"
        self.models = models
        self.repository = repository
        self.topology = topology
        self.mode = mode
        self.interval = settings.poll_repository or 5.0
        self.startup = [n.strip() for n in settings.load_model.split(",") if n.strip()]
        # --testing-service: honour test-only model parameters (a worker that crashes on cue).
        self.testing = settings.testing_service
        self.signing: SigningPolicy | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        # The files a version last failed to load from, and that failed version.
        self._tried: dict[tuple[str, int], tuple[Fingerprint, ServedVersion]] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._copies: Path | None = None  # the private copies of verified versions (0700)
        self._copies_made = threading.Lock()

    async def start(self) -> None:
        if self.mode == "explicit" and "*" not in self.startup:
            await self.load_all(self.startup)
        else:
            await self.load_all()
        if self.mode == "poll":
            self._spawn(self._poll())

    def rescan_soon(self) -> None:
        log.info("SIGHUP: rescanning the model repository")
        self._spawn(self._rescan())

    def stop_watching(self) -> None:
        """No more rescans: the server is shutting down."""
        for task in self._tasks:
            task.cancel()

    async def stop(self) -> None:
        """Stop every version's batcher and workers."""
        for task in list(self._retiring):
            await task
        versions = self.models.all_versions()
        for served in versions:
            served.state = VersionState.UNLOADING
        await asyncio.gather(*(v.batcher.stop() for v in versions if v.batcher))
        await asyncio.gather(*(i.stop() for v in versions for i in v.instances))
        for served in versions:
            served.state = VersionState.UNAVAILABLE
        if self._copies is not None:
            shutil.rmtree(self._copies, ignore_errors=True)

    async def _rescan(self) -> None:
        await self.rescan(unload_missing=self.mode == "poll", only_loaded=self.mode == "explicit")

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self._rescan()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
                    if model.config.platform != ENSEMBLE  # runs on its steps' instances
                }
                prints[name] = {f.version: fingerprint(f.path) for f in model.versions}
            except (RepositoryError, OSError, ValueError) as exc:
                self.models.fail(name, str(exc))
                log.error("model %s not loaded: %s", name, exc)
                self.models.load_failed(name, "repository")
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
            self.models.publish(model.name, versions)
            for files in model.versions:
                served, key = versions[files.version], _key(model.name, files.version)
                if model.config.platform == ENSEMBLE:
                    loads.append(self._start_ensemble(served, files))
                    continue
                if key in unplaced:
                    served.state, served.reason = VersionState.UNAVAILABLE, unplaced[key]
                    log.error(
                        "model %s version %d not placed: %s",
                        model.name,
                        files.version,
                        unplaced[key],
                    )
                    self.models.load_failed(model.name, "placement")
                    continue
                loads.append(self._load_and_warm_up(served, files, placements[key]))
        self.models.changed()
        await asyncio.gather(*loads)
        self.models.check_ensembles()
        self.models.check_fallbacks()
        self.models.loading_done = True
        self.models.changed()

    async def _load_and_warm_up(
        self, served: ServedVersion, files: ModelFiles, placements: list[Placement]
    ) -> None:
        """Load and warm up one version; any failure leaves it UNAVAILABLE with the reason."""
        try:
            await self._load_version(served, files, placements)
            if served.state is VersionState.LOADING:  # loaded: READY once warmed up
                await self._warm_up(served)
        except Exception as exc:
            log.exception("model %s version %d failed to load", served.name, served.version)
            served.state, served.reason = VersionState.UNAVAILABLE, f"loading failed: {exc}"
            self.models.load_failed(served.name, "load")
            await asyncio.gather(*(i.stop() for i in served.instances), return_exceptions=True)
            _drop_copy(served)
            self.models.changed()

    async def _load_version(
        self, served: ServedVersion, files: ModelFiles, placements: list[Placement]
    ) -> None:
        checked = await self._signed(served, files)
        if checked is None:
            return
        files, config = checked
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
                    backend=config.backend,
                    config=config.SerializeToString(),
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
            renamed = fetch_names(config, loaded.outputs)
            datatypes = {o.name: BY_CONFIG_TYPE[o.data_type] for o in served.config.output}
            for instance in served.instances:
                instance.declare_outputs(datatypes, renamed)
            served.validator = RequestValidator(served.config)
            served.batcher = DynamicBatcher(
                policy_from_config(served.config, len(served.instances)),
                lambda batch, requests, deadline: self.models.run_batch(
                    served, batch, requests, deadline
                ),
                served.capacity,
                f"model '{served.name}' version {served.version}",
            )
        except RepositoryError as exc:
            served.state, served.reason = VersionState.UNAVAILABLE, str(exc)
            log.error("model %s version %d not loaded: %s", served.name, served.version, exc)
            self.models.load_failed(served.name, "load")
            await asyncio.gather(*(i.stop() for i in served.instances))
            _drop_copy(served)
            self.models.changed()
            return
        log.info(
            "loaded model %s version %d on %s in %.1f s: inputs %s -> outputs %s",
            served.name,
            served.version,
            ", ".join(f"{i.spec.instance_name} on {i.spec.label}" for i in served.instances),
            time.monotonic() - started,
            _describe(served.config.input, served.config.max_batch_size),
            _describe(served.config.output, served.config.max_batch_size),
        )
        self.models.changed()

    async def _signed(
        self, served: ServedVersion, files: ModelFiles
    ) -> tuple[ModelFiles, mc.ModelConfig] | None:
        """The files and config to load the version from, or None when the signing policy
        refuses it (it is then UNAVAILABLE with the reason)."""
        if self.signing is None:
            return files, served.config
        try:
            return await asyncio.to_thread(self._verified, served, files)
        except SignatureError as exc:
            served.state, served.reason, served.refused = (
                VersionState.UNAVAILABLE,
                f"signature refused: {exc}",
                True,
            )
            log.error("model %s version %d refused: %s", served.name, served.version, exc)
            _drop_copy(served)
            self.models.load_failed(served.name, "signature")
            self.models.changed()
            return None

    def _verified(
        self, served: ServedVersion, files: ModelFiles
    ) -> tuple[ModelFiles, mc.ModelConfig]:
        """Check the version's signature, copying the checked bytes into a private directory:
        the files and the config to load from then, the repository's if it is unsigned and
        that is allowed. Every worker start and restart loads the copy, so nothing written to
        the repository after the check (or a swapped symlink) ever runs."""
        assert self.signing is not None
        with self._copies_made:  # versions are verified in threads, several at once
            if self._copies is None:
                self._copies = Path(tempfile.mkdtemp(prefix="paddlequic-verified-"))  # mode 0700
        copy = Path(tempfile.mkdtemp(prefix=f"{served.name}-{served.version}-", dir=self._copies))
        served.copy = copy
        model_dir = self.repository.root / served.name
        ensemble = served.config.platform == ENSEMBLE
        if not self.signing.check(model_dir, served.name, served.version, copy, ensemble=ensemble):
            _drop_copy(served)
            return files, served.config
        try:
            config = read_config(copy, served.name)
        except RepositoryError as exc:
            raise SignatureError(f"the signed {CONFIG_FILE} cannot be served: {exc}") from exc
        if config != served.config:
            raise SignatureError(f"{served.name}/{CONFIG_FILE} changed while being loaded")
        version_dir = copy / str(served.version)
        relocated = ModelFiles(
            files.version,
            version_dir,
            version_dir / files.model_file.relative_to(files.path),
            version_dir / files.params_file.relative_to(files.path),
        )
        return relocated, config

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
            current = self.models.serving(name)
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
                tried = self._tried.get((name, files.version))
                if tried is not None and tried[0] == prints and old is not None:
                    # Failed before with these very files: not loaded again, and the load
                    # answers with the same failure (whatever serves goes on serving).
                    result[files.version] = old
                    failures.append(tried[1])
                    continue
                candidate = ServedVersion(name, files.version, model.config, fingerprint=prints)
                await self._start_version(candidate, files)
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
            self.models.publish(name, result)
            self.models.check_ensembles()
            self.models.check_fallbacks()
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
        serving = [v for v in self.models.serving(name).values() if v.state is VersionState.READY]
        for version in serving:
            version.reason = f"kept serving: a reload failed: {reason}"
        if not serving:
            self.models.fail(name, reason)
        self.models.load_failed(name, "repository")
        self.models.changed()

    async def unload_model(self, name: str) -> None:
        """Stop serving a model: new requests are refused at once; what its versions hold
        finishes; then their workers exit."""
        check_model_name(name)
        async with self._locks.setdefault(name, asyncio.Lock()):
            versions = self.models.withdraw(name)
            if versions is None:
                raise errors.not_found(f"model '{name}' is not loaded")
            await asyncio.gather(*(self._retire(v, "unloaded") for v in versions.values()))

    async def rescan(self, unload_missing: bool, only_loaded: bool) -> None:
        """Pick up what changed in the repository (SIGHUP, polling)."""
        try:
            names = set(self.repository.model_names())
        except (RepositoryError, OSError) as exc:
            log.error("rescan: %s", exc)  # the models already loaded keep serving
            return
        loaded = set(self.models.loaded_names())
        targets = sorted(loaded) if only_loaded else sorted(names)
        for name in targets:
            if name not in names:
                continue
            try:
                await self.load_model(name)
            except errors.ServiceError as exc:
                log.error("reload of %s: %s", name, exc.message)
        if unload_missing:
            for name in sorted(loaded - names):
                await self.unload_model(name)

    async def _start_version(self, served: ServedVersion, files: ModelFiles) -> None:
        if served.config.platform == ENSEMBLE:
            await self._start_ensemble(served, files)
            return
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

    async def _start_ensemble(self, served: ServedVersion, files: ModelFiles) -> None:
        """An ensemble is ready to take requests once its signature (its config.pbtxt, under
        the signing policy like any model's) and its graph check out; whether its steps can
        run is asked of their models at each request (and by its readiness)."""
        if await self._signed(served, files) is None:
            return
        try:
            served.steps = ensemble.plan(served.config)
        except ensemble.EnsembleError as exc:
            served.state, served.reason = VersionState.UNAVAILABLE, f"ensemble: {exc}"
            log.error("ensemble %s not loaded: %s", served.name, exc)
            self.models.load_failed(served.name, "ensemble")
            return
        served.validator = RequestValidator(served.config)
        served.steps_ready = lambda: self.models.ensemble_ready(served)
        served.state = VersionState.READY
        log.info(
            "loaded ensemble %s: %s",
            served.name,
            " -> ".join(f"{s.model}" for s in served.steps),
        )

    async def _warm_up(self, served: ServedVersion) -> None:
        """Every shape bucket, then the model_warmup samples, before the version takes
        traffic (service/lifecycle/warmup.py); the slowest bucket (the largest) sets the
        watchdog's limit where config.pbtxt sets none."""
        loop = asyncio.get_running_loop()
        assert served.batcher is not None
        slowest = 0.0
        try:
            plan = warm_ups(served.config, served.batcher.policy.shapes)
            for warm_up in plan:
                for _ in range(warm_up.count):
                    started = loop.time()
                    await self.models.infer(served, warm_up.job, started + WARM_UP_TIMEOUT_S)
                    if warm_up.bucket:
                        slowest = max(slowest, loop.time() - started)
        except (errors.ServiceError, WarmUpError) as exc:
            reason = exc.message if isinstance(exc, errors.ServiceError) else str(exc)
            served.state, served.reason = VersionState.UNAVAILABLE, f"warm-up failed: {reason}"
            await self._retire(served, served.reason)
            served.state = VersionState.UNAVAILABLE
            return
        timeout_s = max(MIN_EXECUTION_TIMEOUT_S, WARM_UP_MULTIPLE * slowest)
        buckets = [w for w in plan if w.bucket]
        samples = "".join(f", model_warmup {w.name!r} x{w.count}" for w in plan if not w.bucket)
        log.info(
            "model %s version %d warmed up: %d inferences (%d buckets%s), slowest bucket %.1f ms",
            served.name,
            served.version,
            sum(w.count for w in plan),
            len(buckets),
            samples,
            slowest * 1e3,
        )
        for instance in served.instances:
            if instance.execution_timeout_s is None:
                instance.execution_timeout_s = timeout_s
        served.stats = ModelStats()
        served.state = VersionState.READY
        self.models.changed()

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
        _drop_copy(served)
        if served.state is VersionState.UNLOADING:
            served.state, served.reason = VersionState.UNAVAILABLE, why
        log.info("model %s version %d %s; its workers stopped", served.name, served.version, why)


def fingerprint(directory: Path) -> Fingerprint:
    """What identifies a version's files without reading them: path, size, mtime; with the
    model's config.pbtxt and signature, which it is loaded (and checked) with."""
    entries = []
    model_files = [directory.parent / CONFIG_FILE, directory.parent / SIGNATURE_FILE]
    for file in [p for p in model_files if p.is_file()] + sorted(
        p for p in directory.rglob("*") if p.is_file()
    ):
        stat = file.stat()
        entries.append(
            (file.relative_to(directory.parent).as_posix(), stat.st_size, stat.st_mtime_ns)
        )
    return tuple(entries)


def _drop_copy(served: ServedVersion) -> None:
    if served.copy is not None:
        shutil.rmtree(served.copy, ignore_errors=True)
        served.copy = None


def _key(name: str, version: int) -> str:
    return f"{name}_{version}"


def _device_label(placement: Placement, simulated: bool) -> str:
    if placement.device == "cpu":
        return f"cpu (NUMA {placement.numa_node})" if placement.numa_node >= 0 else "cpu"
    gpus = ",".join(str(i) for i in placement.gpu_indices)
    return f"gpu {gpus} (simulated: CPU predictor)" if simulated else f"gpu {gpus}"


def _describe(tensors: object, max_batch_size: int) -> str:
    batch = [-1] if max_batch_size > 0 else []
    return ", ".join(
        f"{t.name}:{config_type_name(t.data_type).removeprefix('TYPE_')}{batch + list(t.dims)}"
        for t in tensors  # type: ignore[attr-defined]
    )
