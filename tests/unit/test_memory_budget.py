"""MemoryBudget.serving (service/lifecycle/budget.py) with the registry it serves from: a model
not in memory is loaded once whatever the number of callers, each caller waits within its own
deadline, and the load goes on for the others after one gives up. The load itself is a stand-in
that publishes a version when told to (the real one starts workers:
tests/e2e/test_memory_budget.py)."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

from protos.inference import model_config_pb2 as mc
from service.inference import errors
from service.lifecycle.budget import MemoryBudget
from service.registry.versions import ModelRegistry, ServedVersion, VersionState


class Counted:
    """What the budget tells its observer."""

    def __init__(self) -> None:
        self.events: Counter[tuple[str, str]] = Counter()

    def on_model_load(self, model: str, trigger: str) -> None:
        self.events["load", trigger] += 1

    def on_eviction(self, model: str) -> None:
        self.events["evict", model] += 1

    def on_load_wait(self, model: str) -> None:
        self.events["wait", model] += 1

    def on_model_memory(self, model: str, size: int | None) -> None:
        pass


async def retire(served: ServedVersion, why: str) -> None:
    served.state, served.reason = VersionState.UNAVAILABLE, why


async def test_one_load_for_every_caller_each_within_its_deadline() -> None:
    registry = ModelRegistry(lambda: None)
    registry.offer("m", "not loaded yet: loads on its first request")
    observer = Counted()
    locks: dict[str, asyncio.Lock] = {}
    budget = MemoryBudget(
        100, registry, retire, lambda n: locks.setdefault(n, asyncio.Lock()), observer
    )
    go = asyncio.Event()
    loads: list[str] = []

    async def load(name: str) -> None:
        loads.append(name)
        await go.wait()
        registry.publish(
            name, {1: ServedVersion(name, 1, mc.ModelConfig(name=name), VersionState.READY)}
        )

    budget.load = load

    async def call(deadline: float | None) -> ServedVersion:
        async with budget.serving("m", "", deadline) as served:
            return served

    loop = asyncio.get_running_loop()
    patient = [asyncio.create_task(call(None)) for _ in range(3)]
    hurried = asyncio.create_task(call(loop.time() + 0.01))
    with pytest.raises(errors.ServiceError) as late:
        await hurried
    assert late.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert late.value.message == (
        "model 'm' was still loading on demand (--model-memory-budget) when the request's "
        "deadline passed; the load goes on"
    )
    go.set()
    served = await asyncio.gather(*patient)
    assert all(s is served[0] for s in served) and served[0].state is VersionState.READY
    assert loads == ["m"]
    assert observer.events == {("load", "request"): 1, ("wait", "m"): 4}
    async with budget.serving("m", "", None) as again:  # in memory now: no wait, no load
        assert again is served[0]
    assert loads == ["m"] and observer.events["wait", "m"] == 4
