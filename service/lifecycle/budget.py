"""--model-memory-budget: the models in memory stay within a budget of bytes, and a request for
a model that is not loaded loads it, evicting the least recently used idle models first (the
decision: service/lifecycle/eviction.py).

What a model costs is what unloading it gives back: per instance, its declared `memory_mb`
when config.pbtxt sets one (known before the model runs, and its cgroup holds the worker to
it), else the private memory its processes hold once loaded and warmed up
(service/workers/memory.py). A measured size is known only after a load, so a model's first
load makes room for the size it had last time (nothing the first time) and the evictions it
still needs follow the load. A model that alone exceeds the budget is unloaded again and its
requests fail RESOURCE_EXHAUSTED, saying so.

One load at a time, server-wide: loads are the costly work (a Paddle predictor built and
warmed), and one at a time each sees the memory the previous one left. Per model there is one
load; every request for it waits for that one, each within its own deadline."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from service.inference import errors
from service.inference.timers import fail_at
from service.lifecycle.eviction import MB, NoRoom, Resident, plan_room
from service.model.parameters import MEMORY_MB, string_parameters
from service.registry.versions import ModelRegistry, ServedVersion, VersionState
from service.workers import launch
from service.workers.memory import private_bytes

log = logging.getLogger("paddlequic.models")

Retire = Callable[[ServedVersion, str], Awaitable[None]]


class BudgetObserver(Protocol):
    """Told of loads (by trigger: request, explicit, reload), evictions, requests that waited
    for a load, and each model's charged size (None: no longer in memory)."""

    def on_model_load(self, model: str, trigger: str) -> None: ...

    def on_eviction(self, model: str) -> None: ...

    def on_load_wait(self, model: str) -> None: ...

    def on_model_memory(self, model: str, size: int | None) -> None: ...


@dataclass(frozen=True)
class _Charge:
    bytes: int
    loaded_at: float  # the clock's time (ms since the epoch, as ModelStats.last_inference_ms)


class MemoryBudget:
    def __init__(
        self,
        budget_mb: int,
        registry: ModelRegistry,
        retire: Retire,
        lock: Callable[[str], asyncio.Lock],
        observer: BudgetObserver,
        clock: Callable[[], float] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        """`retire`: winds a version down (Retiring.retire); `lock`: a model's lifecycle lock;
        `clock`: the time loads are stamped with, on the clock of the versions' statistics
        (a model's last use is the later of its load and its last request)."""
        self.budget = budget_mb * MB
        self.registry = registry
        self._retire = retire
        self._lock = lock
        self.observer = observer
        self._clock = clock
        self._charges: dict[str, _Charge] = {}  # the models in memory
        self._sizes: dict[str, int] = {}  # each model's size when last loaded, kept after
        self._pinned: set[str] = set()
        self._held: dict[str, int] = {}  # requests inside `serving`, per model name
        self._loads: dict[str, asyncio.Future[None]] = {}
        self._one_load = asyncio.Lock()
        # Lifecycle: loads a model from the repository (set by the lifecycle).
        self.load: Callable[[str], Awaitable[None]] | None = None
        # With front-ends serving calls themselves: brings their counts in (last uses, the
        # requests they hold) before the least recently used model is chosen.
        self.refresh: Callable[[], Awaitable[None]] | None = None

    @contextlib.asynccontextmanager
    async def serving(
        self, name: str, version: str, deadline: float | None
    ) -> AsyncIterator[ServedVersion]:
        """The version a request names, loaded first if it is not in memory (waiting for the
        load under way, if one is, until the request's deadline); the model is not evicted
        while the request is inside the block."""
        self._held[name] = self._held.get(name, 0) + 1
        try:
            if self.registry.on_demand(name):
                await self.loaded(name, deadline)
            yield self.registry.resolve(name, version)
        finally:
            self._held[name] -= 1
            if not self._held[name]:
                del self._held[name]

    async def loaded(self, name: str, deadline: float | None) -> None:
        """Until the model's load (started now, or the one under way) is done, or `deadline`
        (DEADLINE_EXCEEDED; the load goes on)."""
        self.observer.on_load_wait(name)
        load = self._loads.get(name)
        if load is None:
            load = self._loads[name] = asyncio.ensure_future(self._load_on_demand(name))
            load.add_done_callback(functools.partial(self._load_done, name))
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        load.add_done_callback(functools.partial(_relay, waiter))
        timer = fail_at(
            waiter,
            deadline,
            lambda: errors.deadline_exceeded(
                f"model '{name}' was still loading on demand (--model-memory-budget) when "
                "the request's deadline passed; the load goes on"
            ),
        )
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()

    def _load_done(self, name: str, load: asyncio.Future[None]) -> None:
        if self._loads.get(name) is load:
            del self._loads[name]

    async def _load_on_demand(self, name: str) -> None:
        async with self._one_load:
            if not self.registry.on_demand(name):
                return  # loaded, or unloaded, while it waited for its turn
            await self._make_room(name, self._sizes.get(name, 0))
            assert self.load is not None
            self.observer.on_model_load(name, "request")
            await self.load(name)
            await self._charge(name)

    async def loading(
        self, name: str, pin: bool | None, load: Callable[[], Awaitable[None]]
    ) -> None:
        """A load not asked for by a request: RepositoryModelLoad (`pin`: the model is never
        evicted until unloaded), or a rescan's reload (`pin` None: pinned as it was)."""
        async with self._one_load:
            # A model in memory loads again only what changed (often nothing): its charge
            # is corrected once the load is done.
            await self._make_room(name, 0 if name in self._charges else self._sizes.get(name, 0))
            self.observer.on_model_load(name, "explicit" if pin else "reload")
            await load()
            await self._charge(name)
            if pin:
                self._pinned.add(name)

    async def stop(self) -> None:
        """At shutdown: loads under way are cancelled (their callers get UNAVAILABLE)."""
        loads = list(self._loads.values())
        for load in loads:
            load.cancel()
        await asyncio.gather(*loads, return_exceptions=True)

    def forget(self, name: str) -> None:
        """The model was unloaded (RepositoryModelUnload): not charged, not pinned."""
        self._pinned.discard(name)
        if self._charges.pop(name, None) is not None:
            self.observer.on_model_memory(name, None)

    def residents(self) -> list[Resident]:
        """The models in memory, as the eviction policy sees them now."""
        found = []
        for name, charge in self._charges.items():
            versions = list(self.registry.serving(name).values())
            used = max((v.stats.last_inference_ms for v in versions), default=0)
            found.append(
                Resident(
                    name,
                    charge.bytes,
                    max(charge.loaded_at, used),
                    name in self._pinned,
                    name in self._held or any(_busy(v) for v in versions),
                )
            )
        return found

    async def _make_room(self, name: str, needed: int, charged: bool = False) -> None:
        """Evict, one at a time and looking again after each, until `needed` more bytes fit:
        a model that became busy meanwhile stays. `charged`: `name` is loaded and charged
        `needed` already; when no room can be made it is unloaded again."""
        while True:
            if self.refresh is not None:
                await self.refresh()
            residents = [r for r in self.residents() if not (charged and r.name == name)]
            plan = plan_room(residents, needed, self.budget, name)
            if isinstance(plan, NoRoom):
                if charged:
                    await self._evict(name, f"not loaded: {plan.reason}", force=True)
                raise errors.resource_exhausted(plan.reason)
            if not plan.names:
                return
            await self._evict(plan.names[0], self._reason(name))

    async def _charge(self, name: str) -> None:
        """Charge the model what it holds now it is loaded; if that takes the total over the
        budget, evict others as for a load, or, when they cannot make room, the model."""
        versions = [
            v for v in self.registry.serving(name).values() if v.state is VersionState.READY
        ]
        if not versions:
            self.forget(name)
            return
        size = await asyncio.to_thread(_size, versions)
        self._charges[name] = _Charge(size, self._clock())
        self._sizes[name] = size
        self.observer.on_model_memory(name, size)
        log.info(
            "model %s holds %.1f MB (--model-memory-budget %d MB)",
            name,
            size / MB,
            self.budget // MB,
        )
        await self._make_room(name, size, charged=True)

    def _reason(self, loading: str) -> str:
        """What RepositoryIndex says of a model evicted for `loading` (Triton's words for
        a model not loaded: state UNAVAILABLE, a reason)."""
        return (
            f"evicted: least recently used, to make room for '{loading}' within "
            f"--model-memory-budget {self.budget // MB} MB; a request loads it again"
        )

    async def _evict(self, name: str, reason: str, force: bool = False) -> None:
        """Unload the model unless a request took it meanwhile (`force`: whatever holds it):
        requests from now on load it again; its workers have exited on return."""
        async with self._lock(name):
            if not self.registry.serving(name):
                self.forget(name)  # unloaded meanwhile
                return
            if not force and any(r.name == name and r.busy for r in self.residents()):
                return
            versions = self.registry.evict(name, reason)
            self.forget(name)
            self.observer.on_eviction(name)
            log.info("model %s %s", name, reason)
            await asyncio.gather(*(self._retire(v, reason) for v in versions.values()))


def _busy(served: ServedVersion) -> bool:
    """Requests in flight or queued, or an open sequence."""
    queue = served.queue()
    return bool(
        served.active
        or (queue is not None and (queue.queued or queue.in_flight_requests))
        or (served.sequences is not None and served.sequences.live)
    )


def _size(versions: list[ServedVersion]) -> int:
    """Per instance: its declared memory_mb, else its processes' private memory now; and the
    model its instances share, held by their model template (templates.py)."""
    total = 0
    for served in versions:
        declared = string_parameters(served.config).get(MEMORY_MB)
        for instance in served.instances:
            if declared is not None:
                total += int(declared) * MB
            else:
                total += private_bytes(instance.launcher_pid)
        if served.instances and served.instances[0].spec.template:
            load = launch.load_message(served.instances[0].spec)
            total += launch.model_templates().held_bytes(load)
    return total


def _relay(waiter: asyncio.Future[None], load: asyncio.Future[None]) -> None:
    """The load's outcome to one waiter (one that gave up at its deadline stays as it is)."""
    if load.cancelled():
        error: BaseException | None = errors.unavailable(
            "the model's load was cancelled: the server is shutting down"
        )
    else:
        error = load.exception()
    if waiter.done():
        return
    if error is None:
        waiter.set_result(None)
    else:
        waiter.set_exception(error)
