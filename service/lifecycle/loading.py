"""Starting one version: its signature checked, its instances placed and started, its config
completed from what the model declares, its batcher built, then warmed up; or an ensemble,
whose graph is checked. Every failure goes through Lifecycle.fail."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass

from oip.datatypes import BY_CONFIG_TYPE, config_type_name
from protos.inference import model_config_pb2 as mc
from service.batching.batcher import DynamicBatcher, policy_from_config
from service.batching.concurrency import ConcurrencyLimit
from service.batching.sequence_batcher import SequenceBatcher
from service.batching.sequence_queue import SequencePolicy
from service.inference.validation import RequestValidator
from service.inference.waits import WaitGraph
from service.lifecycle.repository import (
    RepositoryError,
    auto_completed,
    check_python_tensors,
    complete_config,
    fetch_names,
)
from service.lifecycle.retiring import Fail
from service.lifecycle.signing import SignatureError
from service.lifecycle.verified_copies import VerifiedCopies
from service.lifecycle.warming import warm_up
from service.lifecycle.warmup import WarmUpError
from service.model import ensemble
from service.model.decoupled import is_decoupled, stream_limits
from service.model.files import ENSEMBLE, PYTHON_BACKEND, ModelFiles
from service.model.parameters import (
    TESTING_PARAMETERS,
    check_parameters,
    python_instance_queues,
    string_parameters,
    worker_memory_mb,
)
from service.model.python_code import bls_reason
from service.model.sequences import (
    SequenceSettings,
    sequence_settings,
    with_sequence_tensors,
    without_sequence_tensors,
)
from service.model.shapes import shape_buckets
from service.placement.instance_groups import (
    frontend_numa_node,
    instance_requests,
    place_all,
    worker_environment,
)
from service.placement.policy import Placement
from service.placement.topology import Topology
from service.registry.versions import ModelRegistry, ServedVersion, VersionState
from service.serving.batch_runner import BatchObserver, BatchRunner
from service.serving.bls import BlsRunner
from service.serving.queue_setup import queue_setup, queueable
from service.serving.queued_batcher import QueuedBatcher, batch_recorder
from service.serving.requests import RequestRunner
from service.workers.instance import WorkerInstance
from service.workers.model_output import BYTES_PER_S, LINES_PER_S, ModelOutput, OutputBudget
from service.workers.spec import WorkerSpec

log = logging.getLogger("paddlequic.models")


@dataclass(frozen=True)
class WorkerLimits:
    """What the server's options bound in every worker (the composition root fills it)."""

    # --max-message-bytes: what one caller may receive, so what a worker may send
    # (service/workers/message_bounds.py).
    max_message_bytes: int = 64 << 20
    # A Python model's prints in the log, per version (--model-output-lines, -bytes).
    output_lines_per_s: float = LINES_PER_S
    output_bytes_per_s: float = BYTES_PER_S
    # --preloaded-launcher: Paddle CPU workers forked from it (service/workers/preloaded.py).
    preloaded: bool = True
    # --model-templates: instances of one such version forked from one process that built its
    # predictor (service/workers/templates.py).
    templates: bool = True
    # --instance-queues: requests straight into the instances' queues, batched by the worker
    # (service/serving/queued_batcher.py); --instance-queue-mb of shared memory each.
    instance_queues: bool = True
    instance_queue_mb: int = 8


class VersionLoader:
    """Brings one version from LOADING to READY, or fails it with the reason."""

    def __init__(
        self,
        registry: ModelRegistry,
        runner: RequestRunner,
        topology: Topology,
        copies: VerifiedCopies,
        observer: BatchObserver,
        fail: Fail,
        testing: bool,
        limits: WorkerLimits,
    ) -> None:
        self.registry = registry
        self.runner = runner
        self.topology = topology
        self.copies = copies
        self.observer = observer
        self.fail = fail
        # --testing-service: honour test-only model parameters (a worker that crashes on cue).
        self.testing = testing
        self.limits = limits
        # Who waits for whom across every BLS call this process runs (all of them: with
        # front-end processes too, workers and their calls live here).
        self.waits = WaitGraph()
        self.bls = BlsRunner(runner, self.waits)  # runs Python models' BLS calls

    async def start(self, served: ServedVersion, files: ModelFiles) -> None:
        """Place and start a version of its own (a reload's)."""
        if served.config.platform == ENSEMBLE:
            await self.start_ensemble(served, files)
            return
        key = placement_key(served.name, served.version)
        try:
            placements, unplaced = place_all(
                {key: instance_requests(key, served.config, self.topology)}, self.topology
            )
        except Exception as exc:  # a bug in placement must not take the other models down
            log.exception("placement of %s failed", key)
            placements, unplaced = {}, {key: f"placement failed: {exc}"}
        if key in unplaced:
            await self.fail(served, unplaced[key], "placement")
            return
        await self.start_placed(served, files, placements[key])

    async def start_placed(
        self, served: ServedVersion, files: ModelFiles, placements: list[Placement]
    ) -> None:
        """Load and warm up one version; any failure leaves it UNAVAILABLE with the reason."""
        try:
            await self._load_version(served, files, placements)
            if served.state is VersionState.LOADING:  # loaded: READY once warmed up
                await warm_up(served, self.runner)
                self.registry.changed()
        except WarmUpError as exc:
            # Not counted: the load-failure counter has no warm-up stage (as it never had).
            await self.fail(served, f"warm-up failed: {exc}", None)
        except Exception as exc:
            log.exception("model %s version %d failed to load", served.name, served.version)
            await self.fail(served, f"loading failed: {exc}", "load")

    async def _load_version(
        self, served: ServedVersion, files: ModelFiles, placements: list[Placement]
    ) -> None:
        checked = await self._signed(served, files)
        if checked is None:
            return
        files, config = checked
        params = string_parameters(config)
        if not self.testing:
            for testing in TESTING_PARAMETERS:
                params.pop(testing, None)
        limits = check_parameters(config)
        served.local_numa = frontend_numa_node(self.topology)
        simulated = self.topology.simulated
        output = ModelOutput(
            served.name,
            OutputBudget(self.limits.output_lines_per_s, self.limits.output_bytes_per_s),
        )
        # Paddle CPU instances of this version fork from one model template that built its
        # predictor (templates.py), unless each is bounded by a memory limit of its own, which
        # has to count its weights.
        shared = (
            self.limits.templates
            and sum(p.device == "cpu" for p in placements) > 1
            and config.backend != PYTHON_BACKEND
            and worker_memory_mb(params, python=False) is None
        )
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
                    decoupled=is_decoupled(config),
                    max_message_bytes=self.limits.max_message_bytes,
                    # Placed on a GPU, simulated or not: started afresh, its environment
                    # (the device's) in force before anything is imported.
                    preloaded=self.limits.preloaded and p.device == "cpu",
                    template=self.limits.preloaded and p.device == "cpu" and shared,
                ),
                self.waits,
                output,
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
            if loaded.config:
                config = auto_completed(config, loaded.config)
            if config.backend == PYTHON_BACKEND:
                check_python_tensors(config)
            # A sequence model's engine also takes its control and state inputs and gives its
            # state outputs; callers see neither.
            settings = sequence_settings(config)  # checked when the config was read
            engine = config if settings is None else with_sequence_tensors(config, settings)
            full = complete_config(engine, loaded.inputs, loaded.outputs)
            renamed = fetch_names(engine, loaded.outputs)
            datatypes = {o.name: BY_CONFIG_TYPE[o.data_type] for o in full.output}
            for instance in served.instances:
                instance.declare_outputs(datatypes, renamed)
            served.config = full if settings is None else without_sequence_tensors(full, settings)
            served.validator = RequestValidator(served.config)
            label = f"model '{served.name}' version {served.version}"
            if settings is not None:
                self._batch_sequences(served, settings, label)
            elif served.decoupled:
                places = stream_limits(served.config)
                served.generations = ConcurrencyLimit(places.concurrent, places.queued, label)
                for instance in served.instances:
                    instance.streams.on_response = functools.partial(
                        self.observer.on_generated, served.name
                    )
            else:
                reason, auto = None, False
                if config.backend == PYTHON_BACKEND:
                    for instance in served.instances:
                        instance.bls.handler = self.bls
                    auto = python_instance_queues(string_parameters(config)) is None
                    if auto and self.limits.instance_queues:  # else no queues to choose
                        reason = await asyncio.to_thread(bls_reason, files.path.parent)
                policy = policy_from_config(served.config, len(served.instances))
                if self.limits.instance_queues and queueable(served.config, reason):
                    queued = QueuedBatcher(
                        served.config,
                        served.instances,
                        queue_setup(served.config, policy, renamed, self.limits.instance_queue_mb),
                        batch_recorder(served, self.observer),
                        label,
                        served.local_numa,
                    )
                    queued.start()
                    served.batcher = queued
                    if auto:
                        log.info(
                            "%s takes its requests through its instances' queues, where it "
                            "cannot make BLS calls: no file of its code names "
                            "pb_utils.InferenceRequest (python_instance_queues false keeps it "
                            "off them, for calls made by code outside its directory)",
                            label,
                        )
                else:
                    if reason is not None:
                        log.info(
                            "%s takes its requests through the server's batcher, not its "
                            "instances' queues, as it may make BLS calls: %s",
                            label,
                            reason,
                        )
                    served.batcher = DynamicBatcher(
                        policy,
                        BatchRunner(served, self.observer),
                        served.capacity,
                        label,
                        served.ready_instances,
                    )
            if (
                config.backend == PYTHON_BACKEND
                and python_instance_queues(string_parameters(config))
                and not isinstance(served.batcher, QueuedBatcher)
            ):
                log.warning(
                    "%s asks for python_instance_queues, but its requests go through the "
                    "server: the instance queues take no sequence or decoupled model, and "
                    "none with --no-instance-queues",
                    label,
                )
        except RepositoryError as exc:
            await self.fail(served, str(exc), "load")
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
        self.registry.changed()

    def _batch_sequences(
        self, served: ServedVersion, settings: SequenceSettings, label: str
    ) -> None:
        """The version's sequence batcher, told when an instance's worker dies (the state it
        held for its sequences is gone)."""
        config, count = served.config, len(served.instances)
        policy = SequencePolicy(
            oldest=settings.oldest,
            instances=count,
            max_batch_size=config.max_batch_size,
            max_candidates=settings.max_candidates,
            idle_s=settings.idle_s,
            preferred_sizes=settings.preferred_sizes,
            max_queue_delay_s=settings.max_queue_delay_s,
            minimum_slot_utilization=settings.minimum_slot_utilization,
            shapes=shape_buckets(config),
            name=label,
        )
        runner = BatchRunner(served, self.observer)
        sequences = SequenceBatcher(
            policy,
            settings,
            runner.run_on,
            runner.worker_of,
            served.instance_capacity,
            functools.partial(self.observer.on_sequences, served.name),
        )
        served.sequences = sequences
        for index, instance in enumerate(served.instances):
            instance.on_death = functools.partial(sequences.lose_instance, index)

    async def _signed(
        self, served: ServedVersion, files: ModelFiles
    ) -> tuple[ModelFiles, mc.ModelConfig] | None:
        """The files and config to load the version from, or None when the signing policy
        refuses it (it is then UNAVAILABLE with the reason)."""
        try:
            return await self.copies.checked(served, files)
        except SignatureError as exc:
            served.refused = True
            await self.fail(served, f"signature refused: {exc}", "signature")
            return None

    async def start_ensemble(self, served: ServedVersion, files: ModelFiles) -> None:
        """An ensemble is ready to take requests once its signature (its config.pbtxt, under
        the signing policy like any model's) and its graph check out; whether its steps can
        run is asked of their models at each request (and by its readiness)."""
        if await self._signed(served, files) is None:
            return
        try:
            served.steps = ensemble.plan(served.config)
        except ensemble.EnsembleError as exc:
            await self.fail(served, f"ensemble: {exc}", "ensemble")
            return
        served.validator = RequestValidator(served.config)
        served.steps_ready = functools.partial(self.registry.ensemble_ready, served)
        served.state = VersionState.READY
        log.info(
            "loaded ensemble %s: %s",
            served.name,
            " -> ".join(f"{s.model}" for s in served.steps),
        )


def placement_key(name: str, version: int) -> str:
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
