"""A front-end's own end of the workers' queues (the parent's side: queue_sharing.py): for each
version the parent lets it queue for itself, a QueuedBatcher of its own over views of the
version's instances (RemoteInstance), so a ModelInfer call it holds goes from this process
straight into a worker's queue and back, with no message to the parent; for each decoupled
version, its places here and a socket of this process's own to each of its workers
(RemoteStreams), so a generation's tokens come straight from the worker; and the ensembles of
the view whose steps are all such versions, run here by the same request runner.

The parent tells it each worker's launches and deaths; a death's fate decides here, as in the
parent, what becomes of the requests this process held in that worker (sent again, alone if
the worker was running them, or failed). What its own watchdog and reply checks find (a hung
worker, one writing what no correct worker writes) goes to the parent, which ends it."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from oip.datatypes import BY_CONFIG_TYPE
from protos.inference import model_config_pb2 as mc
from service.batching.concurrency import ConcurrencyLimit
from service.frontends.descriptors import ViewEntry
from service.frontends.protocol import Kind
from service.frontends.remote_streams import RemoteStreams, RemoteWorker
from service.inference import errors
from service.inference.validation import RequestValidator
from service.model import ensemble
from service.model.decoupled import stream_limits
from service.model.ensemble import MAX_ENSEMBLE_DEPTH
from service.model.parameters import check_parameters
from service.observability.observer import Observer
from service.registry.statistics import ModelStats
from service.registry.versions import ModelRegistry, ServedVersion, VersionState
from service.resilience.breaker import BreakerState
from service.serving.queued_batcher import QueuedBatcher, batch_recorder
from service.workers import deaths, protocol
from service.workers.instance import WorkerInstance
from service.workers.results import Outputs

log = logging.getLogger("paddlequic.frontend")

RELEASE_POLL_S = 0.01


class RemoteInstance(RemoteWorker):
    """A front-end's view of one instance of a version: the QueueHost its QueuedBatcher
    serves through, told by the parent what the worker does."""

    def __init__(self, owner: SharedVersions, token: int, index: int, data: dict[str, Any]):
        super().__init__(data)
        self._owner = owner
        self._token = token
        self._index = index
        self.on_ready: Callable[[], None] | None = None
        self.on_ended: Callable[[deaths.Death], None] | None = None
        self.on_start_failed: Callable[[], None] | None = None
        self.queue_held: Callable[[], int] | None = None
        self.queue_served: Callable[[], bool] | None = None

    def send_queues(self, setup: protocol.Queues, fds: list[int]) -> None:
        """This process's segment for the launch serving now, to the parent, for the worker."""
        self._owner.attach(self._token, self._index, self.launch, fds)

    def kill_misbehaving(self, reason: str, detail: str | None = None) -> None:
        self._owner.trouble(self._token, self._index, self.launch, False, reason)

    def end_hung(self) -> None:
        self._owner.trouble(self._token, self._index, self.launch, True, "")

    def held(self) -> int:
        return 0 if self.queue_held is None else self.queue_held()

    def launched(self) -> None:
        if self.on_ready is not None:
            self.on_ready()

    def ended(self, death: deaths.Death) -> None:
        if self.on_ended is not None:
            self.on_ended(death)

    def start_failed(self) -> None:
        if self.on_start_failed is not None:
            self.on_start_failed()


@dataclass
class _Shared:
    served: ServedVersion
    batcher: QueuedBatcher | None  # None: a decoupled version's (its requests go on sockets)
    instances: Sequence[RemoteInstance | RemoteStreams]

    @property
    def holding(self) -> bool:
        """Whether this process holds requests of the version."""
        queue = self.served.queue()
        assert queue is not None
        return bool(self.served.active or queue.queued or queue.in_flight_requests)

    async def stop(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()
        for instance in self.instances:
            if isinstance(instance, RemoteStreams):
                instance.stop()


class SharedModels(ModelRegistry):
    """The registry an ensemble's steps resolve in, in a front-end: the versions it serves."""

    def __init__(self, shared: SharedVersions) -> None:
        super().__init__(lambda: None)
        self._shared = shared

    def resolve(self, name: str, version: str) -> ServedVersion:
        served = self._shared.resolve(name, version)
        if served is None:  # let go since the call was routed here
            raise errors.unavailable(f"model '{name}' is no longer served by this process")
        return served


class SharedVersions:
    def __init__(
        self,
        frontend: int,
        send: Callable[[Kind, bytes], None],
        queues_socket: Path,
        observer: Observer,
        stats_of: Callable[[str, int], ModelStats],
        max_message: int,
    ) -> None:
        """`send`: a frame to the parent; `stats_of(model, version)`: what a version's calls
        here are counted in (LocalCounts.stats: reported to the parent); `max_message`: what
        a caller may receive (--max-message-bytes)."""
        self._frontend = frontend
        self._max_message = max_message
        self._send = send
        # To the parent's queues socket: this process's segments go there, and the parent's
        # shared-memory regions come from there (region_copies.py).
        self.queues = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.queues.connect(str(queues_socket))
        self._observer = observer
        self._stats_of = stats_of
        self._versions: dict[int, _Shared] = {}
        self._ensembles: dict[int, ServedVersion] = {}
        self._named: dict[tuple[str, str], int] = {}  # the view's (model, version) -> token
        self._fallbacks: dict[int, str] = {}  # by token: the fallback model of one that has one
        self.models = SharedModels(self)  # what this process's request runner resolves in
        self._releasing: set[asyncio.Task[None]] = set()

    def serving(self, token: int) -> ServedVersion | None:
        """The version this process serves itself: one it queues for, or an ensemble whose
        every step (nested ones' too) it serves now, and whose fallback model, if it has one,
        it serves now too (its breaker, this process's, may send the call there); None: the
        parent's."""
        return self._serving(token, 0)

    def resolve(self, name: str, version: str) -> ServedVersion | None:
        """The version a request naming `model` and `version` reaches, if served here."""
        return self._resolve_at(name, version, 0)

    def _serving(self, token: int, depth: int) -> ServedVersion | None:
        if depth >= MAX_ENSEMBLE_DEPTH:
            return None
        fallback = self._fallbacks.get(token)
        if fallback is not None and self._resolve_at(fallback, "", depth + 1) is None:
            return None
        shared = self._versions.get(token)
        if shared is not None:
            return shared.served
        served = self._ensembles.get(token)
        if served is None:
            return None
        for step in served.steps:
            if self._resolve_at(step.model, step.version, depth + 1) is None:
                return None
        return served

    def _resolve_at(self, name: str, version: str, depth: int) -> ServedVersion | None:
        token = self._named.get((name, version))
        return None if token is None else self._serving(token, depth)

    def update(self, payload: bytes, entries: Sequence[ViewEntry]) -> None:
        """The parent's QUEUED: versions new to it get their batcher, those gone are let go
        once what this process holds of them is answered. `entries`: the view it goes with
        (each version's config; the ensembles, run here when their steps are)."""
        # Each version as its number names it (where the view carries its labels).
        described = {entry.token: entry for entry in entries if entry.version}
        queued = {int(e["token"]): e for e in json.loads(payload)}
        for token in list(self._versions):
            if token not in queued:
                self._let_go(token, self._versions.pop(token))
        for token, entry in queued.items():
            if token not in self._versions and token in described:
                self._versions[token] = self._shared(token, entry, described[token])
        self._named = {(entry.model, entry.version): entry.token for entry in entries}
        ensembles: dict[int, ServedVersion] = {}
        for entry in entries:
            if not entry.version:  # "": a version the view also names by its number
                continue
            served = self._ensembles.get(entry.token)  # kept: its config parsed once
            if served is None:
                config = mc.ModelConfig.FromString(entry.config)
                if not config.HasField("ensemble_scheduling"):
                    continue
                served = self._ensemble(entry, config)
            ensembles[entry.token] = served
        self._ensembles = ensembles
        self._fallbacks = {
            token: name
            for token, served in self._served_here()
            if (name := check_parameters(served.config).fallback_model) is not None
        }

    def _served_here(self) -> Iterator[tuple[int, ServedVersion]]:
        """Every version this process may serve, by token: those it queues for, ensembles."""
        for token, shared in self._versions.items():
            yield token, shared.served
        yield from self._ensembles.items()

    def _ensemble(self, entry: ViewEntry, config: mc.ModelConfig) -> ServedVersion:
        """An ensemble of the view: its steps run through this process's runner (over
        `models`), counted here as the parent counts them."""
        served = ServedVersion(entry.model, int(entry.version), config, labels=dict(entry.labels))
        served.stats = self._stats_of(served.name, served.version)
        served.state = VersionState.READY
        served.validator = RequestValidator(config)
        served.steps = ensemble.plan(config)
        return served

    def _shared(self, token: int, entry: dict[str, Any], viewed: ViewEntry) -> _Shared:
        """`viewed`: the version as the view describes it (its config and labels)."""
        config = mc.ModelConfig.FromString(viewed.config)
        name, version = str(entry["name"]), int(entry["version"])
        served = ServedVersion(name, version, config, labels=dict(viewed.labels))
        served.stats = self._stats_of(served.name, served.version)
        served.state = VersionState.READY
        served.validator = RequestValidator(config)
        served.local_numa = _numa_node(entry.get("local_numa"))
        if "setup" not in entry:
            return self._streamed(token, entry, served)
        setup = protocol.decode(base64.b64decode(entry["setup"])[protocol.header_size() :])
        assert isinstance(setup, protocol.Queues)
        instances = [RemoteInstance(self, token, i, d) for i, d in enumerate(entry["instances"])]
        served.instances = cast(list[WorkerInstance], instances)
        label = f"model '{served.name}' version {served.version}"
        batcher = QueuedBatcher(
            config,
            instances,
            setup,
            batch_recorder(served, self._observer),
            label,
            served.local_numa,
        )
        served.batcher = batcher
        batcher.start()
        return _Shared(served, batcher, instances)

    def _streamed(self, token: int, entry: dict[str, Any], served: ServedVersion) -> _Shared:
        """A decoupled version: its requests go to its workers over this process's own
        sockets (remote_streams.py), within places of this process's own."""
        config = served.config
        label = f"model '{served.name}' version {served.version}"
        places = stream_limits(config)
        served.generations = ConcurrencyLimit(places.concurrent, places.queued, label)
        outputs = Outputs()
        outputs.declare({o.name: BY_CONFIG_TYPE[o.data_type] for o in config.output}, {})
        instances = []
        for index, data in enumerate(entry["instances"]):
            instance = RemoteStreams(
                served.name,
                data,
                outputs,
                self._max_message,
                functools.partial(self.attach, token, index),
                functools.partial(self._broke, token, index),
            )
            instance.streams.on_response = functools.partial(
                self._observer.on_generated, served.name
            )
            instances.append(instance)
        served.instances = cast(list[WorkerInstance], instances)
        return _Shared(served, None, instances)

    def _broke(self, token: int, index: int, launch: int, reason: str) -> None:
        self.trouble(token, index, launch, False, reason)

    def held(self) -> dict[str, list[Any]]:
        """The requests this process holds of each version it still serves: queued, in the
        batches workers run, and in each instance's queues (the parent's ListInstances adds
        them to its own)."""
        counts: dict[str, list[Any]] = {}
        for token, shared in self._versions.items():
            batcher = shared.batcher
            queue = shared.served.queue()
            assert queue is not None
            queued, running = queue.queued, queue.in_flight_requests
            if queued or running:
                each = (
                    batcher.held_by_instance()
                    if batcher is not None
                    else [i.outstanding for i in shared.instances if isinstance(i, RemoteStreams)]
                )
                counts[str(token)] = [queued, running, each]
        return counts

    def breakers(self) -> dict[str, list[Any]]:
        """The breakers of the versions this process serves (queued, ensembles) that are not
        closed: state and seconds until the next probe (the parent shows the worst of every
        process's)."""
        return {
            str(token): [served.breaker.state.value, served.breaker.retry_in_s()]
            for token, served in self._served_here()
            if served.breaker.state is not BreakerState.CLOSED
        }

    def told(self, payload: bytes) -> None:
        """WORKER: what a worker of a version did."""
        event = json.loads(payload)
        shared = self._versions.get(int(event["token"]))
        index = int(event["index"])
        if shared is not None and 0 <= index < len(shared.instances):
            shared.instances[index].told(event)

    def attach(self, token: int, index: int, launch: int, fds: list[int]) -> None:
        message = {"frontend": self._frontend, "token": token, "index": index, "launch": launch}
        socket.send_fds(self.queues, [json.dumps(message).encode()], fds)

    def trouble(self, token: int, index: int, launch: int, hung: bool, reason: str) -> None:
        message = {"token": token, "index": index, "launch": launch, "hung": hung}
        self._send(Kind.TROUBLE, json.dumps({**message, "reason": reason}).encode())

    def _let_go(self, token: int, shared: _Shared) -> None:
        task = asyncio.get_running_loop().create_task(self._release(token, shared))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release(self, token: int, shared: _Shared) -> None:
        """Once the requests this process held of a version are answered (as the parent's
        wind-down waits for its own), its queues close and the parent hears it is let go."""
        while shared.holding:
            await asyncio.sleep(RELEASE_POLL_S)
        await shared.stop()
        self._send(Kind.RELEASED, json.dumps({"token": token}).encode())

    async def stop(self) -> None:
        for shared in self._versions.values():
            await shared.stop()
        self._versions.clear()
        asyncio.get_running_loop().remove_reader(self.queues.fileno())
        self.queues.close()


def _numa_node(value: Any) -> int | None:
    """The view's NUMA node (None: the parent knows none)."""
    return None if value is None else int(value)
