"""Dynamic batching through the real server: concurrent requests become batches, and every
request gets exactly its own rows back; by the worker from its own queues (the shared server:
--instance-queues, the default) and by the server's batcher (--no-instance-queues)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1.control_pb2 import ListInstancesRequest
from tests.reference import output_names, run_reference
from tests.servers import ServerProcess, gather_held, model_repository, paused, running_server

CLIENTS = 64
STABLE_LOOKS = 5  # looks at the queue in a row that must agree


@pytest.fixture(scope="module")
def batcher_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("batcher")
    repository = model_repository(root / "models", ["mlp", "text_classifier"])
    with running_server(repository, root / "server.log", ["--no-instance-queues"]) as process:
        yield process


@pytest.fixture(params=["instance queues", "batcher"])
def served(request: pytest.FixtureRequest) -> ServerProcess:
    """The shared server (its workers batch from their queues), then one whose batcher
    forms the batches. Not named `server`: a parametrized fixture of that name made pytest
    parametrize the session's shared server too, and start it again for every test."""
    name = "server" if request.param == "instance queues" else "batcher_server"
    chosen: ServerProcess = request.getfixturevalue(name)
    return chosen


def batch_counts(server: ServerProcess, model: str) -> dict[int, int]:
    stats = server.stub.ModelStatistics(pb.ModelStatisticsRequest(name=model)).model_stats[0]
    return {b.batch_size: b.compute_infer.count for b in stats.batch_stats}


@pytest.mark.float_kernels
async def test_concurrent_clients_are_batched_and_get_their_own_rows(served: ServerProcess) -> None:
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal((1 + i % 3, 256), dtype=np.float32) for i in range(CLIENTS)]
    before = batch_counts(served, "mlp")
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelInfer(build_request("mlp", {"input": x}), timeout=60) for x in inputs]
        responses = await gather_held(served, "mlp", calls)

    after = batch_counts(served, "mlp")
    grown = {size: after.get(size, 0) - before.get(size, 0) for size in after}
    assert max(size for size, count in grown.items() if count) > 1, grown
    assert sum(size * count for size, count in grown.items()) == sum(len(x) for x in inputs)
    for x, response in zip(inputs, responses, strict=True):
        answer = parse_response(response)[output_names("mlp")[0]]
        assert answer.shape == (len(x), 10)
        for row in range(len(x)):
            expected = run_reference("mlp", {"input": x[row : row + 1]})[output_names("mlp")[0]]
            # Within float tolerance, not bit for bit: oneDNN picks kernels by batch size.
            np.testing.assert_allclose(answer[row : row + 1], expected, rtol=1e-5, atol=1e-6)


async def test_bad_values_fail_only_their_own_request_within_a_batch(served: ServerProcess) -> None:
    """Embedding ids out of range pass validation (values are not checked) and make Paddle
    fail; batched with good requests, only the bad one may fail, with INVALID_ARGUMENT."""
    rng = np.random.default_rng(3)
    good = [rng.integers(0, 1000, (1, 7), dtype=np.int64) for _ in range(6)]
    bad = np.full((1, 7), 10**9, dtype=np.int64)
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        batch = [*good[:3], bad, *good[3:]]
        calls = [
            stub.ModelInfer(build_request("text_classifier", {"token_ids": x}), timeout=60)
            for x in batch
        ]
        results = await gather_held(served, "text_classifier", calls, return_exceptions=True)

    error = results.pop(3)
    assert isinstance(error, grpc.aio.AioRpcError)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text_classifier" in (error.details() or "")
    for x, response in zip(good, results, strict=True):
        assert isinstance(response, pb.ModelInferResponse)
        logits = output_names("text_classifier")[0]
        expected = run_reference("text_classifier", {"token_ids": x})[logits]
        np.testing.assert_allclose(parse_response(response)[logits], expected, rtol=1e-4, atol=1e-5)


async def test_a_cancelled_request_still_queued_leaves_the_batch_queue(
    served: ServerProcess,
) -> None:
    """With the worker held still, requests fill its slots, then queue; cancelling a queued
    call takes it out of the queue at once (before the worker moves again)."""
    (instance,) = served.instances("mlp")
    x = np.zeros((1, 256), np.float32)

    async def held(count: int) -> tuple[int, int]:
        """(queued, in a worker) once the server holds `count` requests of mlp, the same in
        STABLE_LOOKS looks in a row (a request just queued may still be on its way to a free
        slot: the batcher has not had its turn yet)."""
        seen: list[tuple[int, int]] = []
        for _ in range(3000):
            listed = await asyncio.to_thread(
                served.control.ListInstances, ListInstancesRequest(model_name="mlp"), timeout=10
            )
            (queue,) = listed.queues
            now = (queue.queued, queue.in_flight)
            seen = [*seen, now] if seen and seen[-1] == now else [now]
            if sum(now) == count and len(seen) >= STABLE_LOOKS:
                return now
            await asyncio.sleep(0.01)
        raise AssertionError(f"the server never held {count} requests")

    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = []
        with paused(instance.pid):
            queued = 0
            while queued == 0:  # one at a time: each fills a slot until none is left
                calls.append(stub.ModelInfer(build_request("mlp", {"input": x}), timeout=60))
                queued, _ = await held(len(calls))
            victim = stub.ModelInfer(build_request("mlp", {"input": x}), timeout=60)
            assert await held(len(calls) + 1) == (queued + 1, len(calls) - queued)
            victim.cancel()
            assert await held(len(calls)) == (queued, len(calls) - queued)
        for call in calls:
            await call
    assert victim.cancelled()
