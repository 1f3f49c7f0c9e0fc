"""Where a BLS call's batch goes (service/serving/batch_runner.py with the instances' shared
wait-for graph): never behind the batch that made the call, whatever the routing's random
choice, while a client's batch may go anywhere; and a batch sent to an instance holds its
callers there until it is answered."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from protos.inference import model_config_pb2 as mc
from service.batching.assemble import Batch
from service.inference.calls import ROOT, CallChain
from service.inference.waits import Wait, WaitGraph
from service.model.files import ModelFiles
from service.observability.logs import LineBudget, RequestLog
from service.observability.observer import Observer
from service.registry.versions import ServedVersion
from service.serving.batch_runner import BatchRunner
from service.workers.instance import WorkerInstance
from service.workers.spec import WorkerSpec
from service.workers.worker_process import State

FILES = ModelFiles(1, Path("/nonexistent"), Path("model.py"), Path("model.py"))


def instances(graph: WaitGraph, count: int) -> list[WorkerInstance]:
    made = [WorkerInstance(WorkerSpec(f"a_{i}", "a", FILES, {}), graph) for i in range(count)]
    for instance in made:
        instance.state = State.READY
    return made


def batch(chain: CallChain) -> Batch:
    return Batch((), (), 0, (1,), chain)


def test_a_calls_batch_never_goes_behind_its_caller() -> None:
    """Model a's two instances: a1 runs a request whose call to a waits in a's batcher. Its
    batch goes to a2 every time; a client's batch goes either way."""

    async def picks() -> tuple[set[str], set[str]]:
        graph = WaitGraph()
        a1, a2 = instances(graph, 2)
        served = ServedVersion("a", 1, mc.ModelConfig(name="a"), instances=[a1, a2])
        observer = Observer(None, RequestLog(1e9, 0.0, None, LineBudget(10, 1.0)), None)
        runner = BatchRunner(served, observer)
        call = ROOT.called_from(id(a1))
        with graph.added((Wait(id(a1), frozenset({id(a1), id(a2)})),)):
            assert a1.would_wait_for_itself(batch(call))
            assert not a2.would_wait_for_itself(batch(call))
            called = {runner._pick_instance(batch(call)).spec.instance_name for _ in range(64)}
            clients = {runner._pick_instance(batch(ROOT)).spec.instance_name for _ in range(64)}
        return called, clients

    called, clients = asyncio.run(picks())
    assert called == {"a_1"}
    assert clients == {"a_0", "a_1"}


def test_a_batch_sent_to_an_instance_holds_its_callers_until_it_ends() -> None:
    """a1's call runs on a2 (still starting, so it waits there): a1 waits on a2, so a2 calling
    a1 would close a cycle; once the batch ends nothing is held."""

    async def held() -> tuple[int, bool, int]:
        graph = WaitGraph()
        a1, a2 = instances(graph, 2)
        task = asyncio.create_task(a2.infer(batch(ROOT.called_from(id(a1))), None))
        await asyncio.sleep(0)
        holding = len(graph)
        cycle = graph.blocks((Wait(id(a2), frozenset({id(a1)})),))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return holding, cycle, len(graph)

    assert asyncio.run(held()) == (1, True, 0)
