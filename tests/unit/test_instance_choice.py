"""Which instance's queues a process writes a request into (`QueuedBatcher` over
`InstanceQueue`s): the least loaded by what this process holds there and what the worker says
it holds of other processes' requests (front-ends', --frontends N), and instances on this
process's NUMA node first. Real segments, rings and eventfds; the worker's side written by the
worker's own `Producer` over the descriptors the process hands it, as a worker maps them."""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import AsyncIterator, Callable

import pytest

from oip.datatypes import BY_NAME
from protos.inference import model_config_pb2 as mc
from service.batching.batcher import policy_from_config
from service.inference.jobs import InferJob, InputTensor
from service.queues.layout import MAX_OTHERS_HELD
from service.serving.queue_setup import queue_setup
from service.serving.queued_batcher import QueuedBatcher
from service.workers import deaths, protocol
from service.workers.producers import Producer
from service.workers.worker_process import State

REQUESTS = 12
STOPPED = deaths.Death("was stopped by the test", deaths.Fate.FAIL, blamed=False)


class Host:
    """An instance whose worker is ready: it keeps the descriptors its queues come with."""

    def __init__(self, numa_node: int) -> None:
        self.state = State.READY
        self.start_failure: str | None = None
        self.launch = 1
        self.execution_timeout_s: float | None = None
        self.on_ready: Callable[[], None] | None = None
        self.on_ended: Callable[[deaths.Death], None] | None = None
        self.on_start_failed: Callable[[], None] | None = None
        self.queue_held: Callable[[], int] | None = None
        self.queue_served: Callable[[], bool] | None = None
        self._numa_node = numa_node
        self.producer: Producer | None = None

    @property
    def numa_node(self) -> int:
        return self._numa_node

    def send_queues(self, setup: protocol.Queues, fds: list[int]) -> None:
        """The worker's end of the segment, mapped as the worker maps it (queued_loop._add);
        a worker started again maps its new one."""
        if self.producer is not None:
            self.release()
        segment = mmap.mmap(fds[0], setup.layout.size)
        self.producer = Producer(setup.layout, segment, os.dup(fds[1]), os.dup(fds[2]))

    def release(self) -> None:
        if self.producer is None:
            return
        for end in (self.producer.requests, self.producer.replies, self.producer.running):
            end.release()
        self.producer.segment.close()
        os.close(self.producer.wake_in)
        os.close(self.producer.wake_out)
        self.producer = None

    def kill_misbehaving(self, reason: str, detail: str | None = None) -> None:
        raise AssertionError(f"killed as misbehaving: {reason}")

    def end_hung(self) -> None:
        raise AssertionError("ended as hung")


def config() -> mc.ModelConfig:
    made = mc.ModelConfig(name="mlp", max_batch_size=8)
    made.input.add(name="x", data_type=mc.TYPE_FP32, dims=[4])
    made.output.add(name="y", data_type=mc.TYPE_FP32, dims=[2])
    return made


def setup_of(served_config: mc.ModelConfig, instances: int) -> protocol.Queues:
    return queue_setup(served_config, policy_from_config(served_config, instances), {}, 4)


def job() -> InferJob:
    return InferJob((InputTensor("x", BY_NAME["FP32"], (1, 4), bytes(16)),), ("y",), 1)


@pytest.fixture
async def hosts() -> AsyncIterator[list[Host]]:
    made: list[Host] = []
    yield made
    for host in made:
        host.release()


async def placed(
    made: list[Host], numa_nodes: list[int], local_numa: int | None, others: list[int]
) -> list[int]:
    """Where REQUESTS requests go among instances on `numa_nodes`, each worker saying it holds
    `others` of other processes' requests."""
    hosts = [Host(node) for node in numa_nodes]
    made += hosts
    served_config = config()
    setup = setup_of(served_config, len(hosts))
    batcher = QueuedBatcher(served_config, hosts, setup, lambda *_: None, "mlp", local_numa)
    batcher.start()
    for host, count in zip(hosts, others, strict=True):
        assert host.producer is not None
        host.producer.others_held(count)
    futures = [batcher.enqueue(job(), None) for _ in range(REQUESTS)]
    held = batcher.held_by_instance()
    for future in futures:
        future.cancel()
    for host in hosts:
        assert host.on_ended is not None
        host.on_ended(STOPPED)
    await asyncio.sleep(0)
    return held


async def test_a_worker_holding_other_processes_requests_gets_fewer_of_this_ones(
    hosts: list[Host],
) -> None:
    # Nobody else's requests: this process's own spread evenly (two choices of two).
    assert await placed(hosts, [0, 0], 0, [0, 0]) == [REQUESTS // 2] * 2
    # The first worker holds 8 of a front-end's: this process fills the second up to that,
    # then both evenly (12 = 8 + 2 + 2).
    assert await placed(hosts, [0, 0], 0, [8, 0]) == [2, 10]
    # A worker draws no load by what it says: at most a count past any queue's bound.
    assert await placed(hosts, [0, 0], 0, [2**64 - 1, 0]) == [0, REQUESTS]
    assert MAX_OTHERS_HELD > REQUESTS


async def test_instances_on_this_process_s_numa_node_come_first_until_clearly_busier(
    hosts: list[Host],
) -> None:
    near, far = await placed(hosts, [0, 1], 0, [0, 0])
    assert near > far > 0  # the far one takes work once the near one holds clearly more
    # The near one holds 20 of others': the far one takes this process's requests.
    assert await placed(hosts, [0, 1], 0, [20, 0]) == [0, REQUESTS]
    # No node known (the process runs on no node's CPUs in particular): no favour.
    assert await placed(hosts, [0, 1], None, [0, 0]) == [REQUESTS // 2] * 2
