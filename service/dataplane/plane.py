"""What every protocol's routes do, once: the server's and its models' metadata, readiness,
configuration and statistics, and running a decoded request through the request runner.

gRPC's servicer (service/api) and the REST routes (service/http) are conversions around it,
as MLServer's dataplane is: a request is decoded from its wire format into a job, and an
answer encoded back, but what is asked of the registry and the runner, and what an unknown
model or version answers, is decided here for both."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from importlib import metadata

import grpc

from oip.datatypes import BY_CONFIG_TYPE
from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.dataplane.shared_memory import SharedMemory
from service.inference import errors
from service.inference.jobs import InferJob, OutputTensor
from service.inference.shared_memory import Caller
from service.inference.validation import Decoding, decoded
from service.lifecycle.lifecycle import Lifecycle
from service.registry.versions import ModelRegistry, ServedVersion, unknown_model
from service.serving.requests import RequestRunner

# The installed distribution's version (set from clients.__version__ at build time): the server
# never imports the client package.
SERVER_VERSION = metadata.version("paddlequic")
# Triton's extensions this server implements, in Triton's order; system_shared_memory is
# added unless --shared-memory is off. Not listed: cuda_shared_memory (its
# RPCs answer as Triton without a GPU does: nothing registers), trace and logging (no
# settings RPCs), model_repository(unload_dependents).
EXTENSIONS = (
    "classification",
    "sequence",
    "model_repository",
    "schedule_policy",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
    "statistics",
)


@dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]


@dataclass(frozen=True)
class TensorMetadata:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1: any size (the batch dimension of a batching model)


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorMetadata, ...]
    outputs: tuple[TensorMetadata, ...]


@dataclass(frozen=True)
class Inferred:
    """A request's outputs and who answered them."""

    requested: ServedVersion
    answered: ServedVersion  # `requested`, or its fallback model while its circuit is open
    outputs: tuple[OutputTensor, ...]

    @property
    def fallback(self) -> bool:
        return self.answered is not self.requested


class InferencePlane:
    """Running a decoded request, which every process holding calls does: the parent's data
    plane, and a front-end's for the versions it serves itself (service/frontends/rest_here.py).
    Which version a request names, and where its shared-memory regions are, is each one's own."""

    def __init__(self, runner: RequestRunner, shared_memory: SharedMemory) -> None:
        self.runner = runner
        self.shared_memory = shared_memory

    def holds_regions(self, caller: Caller, names: Iterable[str]) -> bool:
        """Whether this process holds the caller's regions named (registered here, or copied
        here); where not, the request goes to the process that does."""
        return True

    def serving(
        self, name: str, version: str, deadline: float | None
    ) -> AbstractAsyncContextManager[ServedVersion]:
        raise NotImplementedError

    async def admitted(self, served: ServedVersion, admit: Callable[[], Decoding]) -> InferJob:
        """The request as a job for `served`, from `admit` (its wire format's checks against
        the version's validator), decoded in a thread when its shapes declare much
        per-element work; a refused request counts as one of its failures."""
        started = time.perf_counter_ns()
        try:
            assert served.validator is not None  # a resolved version serves
            return await decoded(admit())
        except errors.ServiceError:
            served.stats.record_failure(time.perf_counter_ns() - started)
            raise

    async def infer(
        self,
        served: ServedVersion,
        job: InferJob,
        deadline: float | None,
        class_counts: Mapping[str, int],
    ) -> Inferred:
        """Run the job (on `served`'s fallback while its circuit is open); the outputs named
        in `class_counts` come back as Triton's classification extension ranks them."""
        answered, result = await self.runner.infer(served, job, deadline)
        produced = result.outputs
        if class_counts:
            produced = answered.classified(produced, class_counts)
        return Inferred(served, answered, produced)


class DataPlane(InferencePlane):
    def __init__(
        self,
        models: ModelRegistry,
        runner: RequestRunner,
        lifecycle: Lifecycle,
        server_name: str,
        shared_memory: SharedMemory,
        control_mode: str,
    ) -> None:
        """`server_name`: what server metadata answers (--server-name); `shared_memory`: the
        regions every protocol's callers registered (--shared-memory off: the extension is not
        listed); `control_mode`:
        --model-control-mode (explicit: models are loaded and unloaded on request)."""
        super().__init__(runner, shared_memory)
        self.models = models
        self.lifecycle = lifecycle
        self.server_name = server_name
        self.control_mode = control_mode
        # Set with front-end processes: asks each for the counts of the calls it served
        # itself (added to the versions' statistics) before they are read.
        self.refresh_stats: Callable[[], Awaitable[None]] | None = None

    @property
    def ready(self) -> bool:
        return self.models.all_ready

    def server_metadata(self) -> ServerMetadata:
        extensions = list(EXTENSIONS)
        if self.shared_memory.mode != "off":
            extensions.insert(extensions.index("binary_tensor_data"), "system_shared_memory")
        return ServerMetadata(self.server_name, SERVER_VERSION, tuple(extensions))

    def model_ready(self, name: str, version: str) -> bool:
        """Whether the version serves; a name or version that cannot be one raises
        INVALID_ARGUMENT, an unknown or failed one is not ready."""
        try:
            served = self.models.resolve(name, version)
        except errors.ServiceError as exc:
            if exc.code is grpc.StatusCode.INVALID_ARGUMENT:
                raise
            return False
        return served.ready

    def model_metadata(self, name: str, version: str) -> ModelMetadata:
        served = self.models.resolve(name, version)
        config = served.config
        batch = (-1,) if config.max_batch_size > 0 else ()

        return ModelMetadata(
            served.name,
            tuple(str(v.version) for v in self.models.versions_of(served.name)),
            config.platform,
            tuple(_tensor(t.name, t.data_type, batch + tuple(t.dims)) for t in config.input),
            tuple(_tensor(t.name, t.data_type, batch + tuple(t.dims)) for t in config.output),
        )

    def model_config(self, name: str, version: str) -> mc.ModelConfig:
        return self.models.resolve(name, version).config

    async def statistics(self, name: str, version: str) -> list[ServedVersion]:
        """The versions whose statistics are asked for: one, a model's, or every one (no
        name), with every call answered so far counted."""
        if self.refresh_stats is not None:
            await self.refresh_stats()
        if not name:
            return self.models.all_versions()
        chosen = [self.models.resolve(name, version)] if version else self.models.versions_of(name)
        if not chosen:
            raise unknown_model(f"'{name}'", "it has no version loaded")
        return chosen

    async def repository_index(
        self, ready_only: bool
    ) -> list[pb.RepositoryIndexResponse.ModelIndex]:
        """Every model the repository holds, with its versions' states (only those that
        serve: `ready_only`)."""
        entries = await self.lifecycle.index()
        return [e for e in entries if e.state == "READY"] if ready_only else entries

    async def load(self, name: str, config: str | None, files: Mapping[str, bytes]) -> None:
        """Load or reload; returns once the new versions serve (or raises why they do not).
        Triton's parameters: `config` (a ModelConfig in JSON, in place of config.pbtxt) and
        the model's files (with `config`)."""
        self._check_explicit_control()
        await self.lifecycle.load_model(name, config, files, explicit=True)

    async def unload(self, name: str) -> None:
        self._check_explicit_control()
        await self.lifecycle.unload_model(name)

    def _check_explicit_control(self) -> None:
        if self.control_mode != "explicit":
            raise errors.ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"explicit model load / unload is not allowed in model control mode "
                f"'{self.control_mode}'; start the server with --model-control-mode explicit",
            )

    def resolve(self, name: str, version: str) -> ServedVersion:
        return self.models.resolve(name, version)

    async def in_memory(self, name: str, deadline: float | None) -> None:
        """Under --model-memory-budget, a model not in memory is loaded first (within
        `deadline`) for what a client asks before it infers: its metadata, its config."""
        budget = self.lifecycle.budget
        if budget is not None and self.models.on_demand(name):
            await budget.loaded(name, deadline)

    def serving(
        self, name: str, version: str, deadline: float | None
    ) -> AbstractAsyncContextManager[ServedVersion]:
        """The version an inference request names, for the duration of the request: under
        --model-memory-budget loaded first if it is not in memory (within `deadline`), and
        not evicted until the block ends."""
        budget = self.lifecycle.budget
        if budget is None:
            return Resolved(self.models.resolve(name, version))
        return budget.serving(name, version, deadline)


class Resolved(AbstractAsyncContextManager[ServedVersion]):
    """A version already resolved, as `serving` answers without a budget (no generator)."""

    def __init__(self, served: ServedVersion) -> None:
        self._served = served

    async def __aenter__(self) -> ServedVersion:
        return self._served

    async def __aexit__(self, *exc: object) -> None:
        return None


def _tensor(name: str, data_type: mc.DataType, shape: tuple[int, ...]) -> TensorMetadata:
    return TensorMetadata(name, BY_CONFIG_TYPE[data_type].name, shape)
