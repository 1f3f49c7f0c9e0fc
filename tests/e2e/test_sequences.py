"""Stateful sequences (Triton's sequence batcher) on the `kws` example, a GRU keyword spotter
whose recurrent state the server carries between a sequence's requests (implicit state):
interleaved sequences answer as each one run alone (within float tolerance), on both
transports, unary and streamed; the errors a caller can cause; the live-sequence bound and the
idle timeout; a worker killed mid-sequence; the metrics."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import random
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from clients.inference_client import AsyncInferenceClient, InferenceClient
from clients.sequences import SequenceParameters
from protos.inference import grpc_service_pb2 as pb
from tests.interop.test_grpcurl import GRPCURL, grpcurl_ok
from tests.reference import kws_reference
from tests.servers import (
    EXAMPLE_MODELS,
    ServerProcess,
    client_args,
    eventually,
    model_repository,
    running_server,
)

Array = np.ndarray[Any, Any]
MODEL = "kws"
# kws with room for 2 live sequences (direct: max_batch_size 2 x 1 instance) that expire
# after 0.3 s idle.
SMALL = "kws_small"
SMALL_LIVE = 2
SMALL_IDLE_US = 300_000
# A Python model that keeps its own state per correlation id, in two instances.
RUNNING_SUM = "running_sum"
RUNNING_SUM_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "python_sequence"
FRAMES, FEATURES = 8, 40
COUNT, LENGTH = 6, 5
CALL_TIMEOUT_S = 60.0
# The same sequence's scores alone and batched with others, on any x86-64 CPU: softmax
# outputs near 0.1, float32 kernels that may reorder sums by batch size (measured: at most
# 3e-8 apart with AVX2 kernels).
SAME_RTOL, SAME_ATOL = 1e-5, 1e-6


def kws_copy(repository: Path, name: str, **replaced: str) -> Path:
    """kws's program under a config of its own (`replaced`: old text -> new)."""
    target = repository / name
    target.mkdir()
    (target / "1").symlink_to(EXAMPLE_MODELS / MODEL / "1")
    config = (EXAMPLE_MODELS / MODEL / "config.pbtxt").read_text()
    config = config.replace(f'name: "{MODEL}"', f'name: "{name}"')
    for old, new in replaced.items():
        assert old in config
        config = config.replace(old, new)
    (target / "config.pbtxt").write_text(config)
    return target / "config.pbtxt"


def small_model(repository: Path) -> None:
    """A small bound and a short idle timeout."""
    kws_copy(
        repository,
        SMALL,
        **{
            "max_batch_size: 64": f"max_batch_size: {SMALL_LIVE}",
            "max_sequence_idle_microseconds: 5000000": (
                f"max_sequence_idle_microseconds: {SMALL_IDLE_US}"
            ),
        },
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("sequences")
    repository = model_repository(root / "models", [MODEL, "mlp"])
    small_model(repository)
    shutil.copytree(RUNNING_SUM_FIXTURE, repository / RUNNING_SUM)
    with running_server(repository, root / "log", ["--certs-dir", str(certs_dir)]) as process:
        yield process


def chunks(seed: int, length: int = LENGTH) -> list[Array]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, FRAMES, FEATURES), dtype=np.float32) for _ in range(length)]


async def run_sequence(client: AsyncInferenceClient, frames: list[Array]) -> list[Array]:
    sequence = client.sequence(MODEL)
    return [
        (await sequence.infer({"features": chunk}, end=i == len(frames) - 1))["scores"]
        for i, chunk in enumerate(frames)
    ]


def status(error: pytest.ExceptionInfo[grpc.RpcError]) -> tuple[grpc.StatusCode, str]:
    """A failed call's status (grpc.Call on HTTP/2, grpc.aio.AioRpcError from the clients)."""
    call = error.value
    assert isinstance(call, grpc.Call | grpc.aio.AioRpcError)
    return call.code(), call.details() or ""


def batched_rows(server: ServerProcess) -> int:
    """Requests of kws that ran in batches of more than one sequence, so far."""
    request = pb.ModelStatisticsRequest(name=MODEL)
    (stats,) = server.stub.ModelStatistics(request, timeout=10).model_stats
    return sum(b.batch_size * b.compute_infer.count for b in stats.batch_stats if b.batch_size > 1)


def with_state_of(own: list[Array], other: list[Array], step: int) -> Array:
    """The scores `own`'s chunk `step` would get on `other`'s state: what a batcher that mixed
    up two sequences' states would answer."""
    return kws_reference([*other[:step], own[step]])[-1]


@pytest.mark.float_kernels
@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_interleaved_sequences_answer_as_each_alone(
    server: ServerProcess, certs_dir: Path, transport: str
) -> None:
    """COUNT sequences at once, their requests interleaving at random in the server's
    batches, against the same sequences one at a time and the in-process program's (its state
    carried by hand): the same scores within SAME_RTOL and SAME_ATOL, and never those of another
    sequence's state, which differ by far more.

    Not bit for bit: oneDNN picks its GEMM kernels by CPU and batch size, so a row's scores in
    a batch of 6 may differ in the last bits from the same row alone (2e-8 on AVX2-only hosts,
    identical on AVX-512 ones)."""
    inputs = [chunks(seed) for seed in range(COUNT)]
    async with AsyncInferenceClient(**client_args(server, certs_dir, transport)) as client:
        alone = [await run_sequence(client, frames) for frames in inputs]
        before = batched_rows(server)
        together = await asyncio.gather(*(run_sequence(client, frames) for frames in inputs))
    assert batched_rows(server) > before, "no batch held two sequences"
    for index, (frames, single, batched) in enumerate(zip(inputs, alone, together, strict=True)):
        for a, b in zip(single, batched, strict=True):
            np.testing.assert_allclose(b, a, rtol=SAME_RTOL, atol=SAME_ATOL)
        expected = kws_reference(frames)
        for served, reference in zip(single, expected, strict=True):
            np.testing.assert_allclose(served, reference, rtol=1e-4, atol=1e-6)
        # Each step's scores are this sequence's state's: another's is far outside the tolerance.
        for step in range(1, LENGTH):
            for other in inputs[:index] + inputs[index + 1 :]:
                foreign = with_state_of(frames, other, step)
                assert np.abs(batched[step] - foreign).max() > 100 * SAME_ATOL
    # Each sequence's scores change with its state: a server that dropped it would not match.
    assert not np.allclose(alone[0][1], kws_reference(inputs[0][1:2])[0])


@pytest.mark.float_kernels
@pytest.mark.parametrize("transport", ["h2", "h3"])
def test_one_stream_carries_many_sequences_in_order(
    server: ServerProcess, certs_dir: Path, transport: str
) -> None:
    """Every request of COUNT sequences written to one ModelStreamInfer at once, round robin:
    each sequence's responses are its scores run alone (the stream keeps its order)."""
    assert_one_stream_keeps_each_sequence_in_order(server, certs_dir, transport)


def assert_one_stream_keeps_each_sequence_in_order(
    server: ServerProcess, certs_dir: Path, transport: str
) -> None:
    inputs = [chunks(100 + seed) for seed in range(COUNT)]
    sequences = [SequenceParameters() for _ in inputs]
    order = [(s, i) for i in range(LENGTH) for s in range(COUNT)]
    random.Random(0).shuffle(order)
    order.sort(key=lambda pair: pair[1])  # each sequence's requests stay in its order
    requests = [
        sequences[s].request(
            MODEL, {"features": inputs[s][i]}, end=i == LENGTH - 1, request_id=f"{s}.{i}"
        )
        for s, i in order
    ]
    with InferenceClient(**client_args(server, certs_dir, transport)) as client:
        responses = list(client.stream_infer(requests, timeout=CALL_TIMEOUT_S))
    assert [r.error for r in responses if r.error] == []
    scores = {r.request_id: r.outputs["scores"] for r in responses}
    for s, frames in enumerate(inputs):
        for i, expected in enumerate(kws_reference(frames)):
            np.testing.assert_allclose(scores[f"{s}.{i}"], expected, rtol=1e-4, atol=1e-6)


def test_a_request_outside_a_sequence_is_refused(server: ServerProcess) -> None:
    chunk = chunks(7, 1)[0]
    with InferenceClient(server.url) as client:
        with pytest.raises(grpc.RpcError) as missing:
            client.infer(MODEL, {"features": chunk})
        with pytest.raises(grpc.RpcError) as unknown:
            client.infer(MODEL, {"features": chunk}, parameters={"sequence_id": 987654321})
        with pytest.raises(grpc.RpcError) as rows:
            client.sequence(MODEL).infer({"features": np.concatenate([chunk, chunk])})
        with pytest.raises(grpc.RpcError) as kind:
            client.infer(MODEL, {"features": chunk}, parameters={"sequence_id": 1.5})
        sequence = client.sequence(MODEL, sequence_id="a string id")
        sequence.infer({"features": chunk}, end=True)
        with pytest.raises(grpc.RpcError) as ended:
            client.infer(MODEL, {"features": chunk}, parameters={"sequence_id": "a string id"})
        # The model and the server are fine: a good sequence still runs.
        assert client.sequence(MODEL).infer({"features": chunk})["scores"].shape == (1, 12)
    for error in (missing, rows, kind, ended):
        assert status(error)[0] == grpc.StatusCode.INVALID_ARGUMENT, status(error)[1]
    assert status(unknown)[0] == grpc.StatusCode.NOT_FOUND
    assert "correlation ID" in status(missing)[1]
    assert "sequence_start" in status(unknown)[1]
    assert "batch size 1" in status(rows)[1]
    assert "'a string id'" in status(ended)[1] and "ended" in status(ended)[1]


def live_sequences(server: ServerProcess, model: str) -> float:
    return sum(
        s.value
        for s in server.metrics()
        if s.name == "paddlequic_live_sequences" and s.labels["model"] == model
    )


def sequence_events(server: ServerProcess, model: str) -> dict[str, float]:
    return {
        s.labels["event"]: s.value
        for s in server.metrics()
        if s.name == "paddlequic_sequences_total" and s.labels["model"] == model
    }


def test_live_sequences_are_bounded_and_idle_ones_expire(server: ServerProcess) -> None:
    """SMALL holds SMALL_LIVE live sequences: one more start is RESOURCE_EXHAUSTED naming the
    limit; ending one makes room; an idle one expires and its next request says so."""
    chunk = chunks(8, 1)[0]
    with InferenceClient(server.url) as client:
        held = [client.sequence(SMALL) for _ in range(SMALL_LIVE)]
        for sequence in held:
            sequence.infer({"features": chunk})
        with pytest.raises(grpc.RpcError) as full:
            client.sequence(SMALL).infer({"features": chunk})
        held[0].infer({"features": chunk}, end=True)
        extra = client.sequence(SMALL)
        extra.infer({"features": chunk})
        assert live_sequences(server, SMALL) == SMALL_LIVE
        eventually(lambda: live_sequences(server, SMALL) == 0, "expired")
        with pytest.raises(grpc.RpcError) as expired:
            extra.infer({"features": chunk})
    assert status(full)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"maximum of {SMALL_LIVE} live sequences" in status(full)[1]
    assert status(expired)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "expired after 0.3 s" in status(expired)[1]
    events = sequence_events(server, SMALL)
    assert events["start"] == SMALL_LIVE + 1
    assert events["end"] == 1
    assert events["expire"] == SMALL_LIVE


@pytest.fixture
def killable(tmp_path: Path, certs_dir: Path) -> Iterator[ServerProcess]:
    """A server of its own: the test kills its kws worker."""
    repository = model_repository(tmp_path / "models", [MODEL, "mlp"])
    with running_server(repository, tmp_path / "log", ["--certs-dir", str(certs_dir)]) as process:
        yield process


def test_a_killed_worker_ends_its_sequences(killable: ServerProcess) -> None:
    """The worker holding a sequence dies between two of its requests: the next one is
    UNAVAILABLE saying it must start again (never a silent restart from zero); other models
    go on, and a new sequence runs on the restarted worker as it does alone."""
    server = killable
    first, second = chunks(20, 3), chunks(21, 3)
    with InferenceClient(server.url) as client:
        sequence = client.sequence(MODEL)
        sequence.infer({"features": first[0]})
        (worker,) = server.instances(MODEL)
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as lost:
            sequence.infer({"features": first[1]})
        # Its later requests are refused the same way; nothing restarted it from zero.
        with pytest.raises(grpc.RpcError) as again:
            sequence.infer({"features": first[2]}, end=True)
        assert client.infer("mlp", {"input": np.ones((1, 256), np.float32)})["probabilities"].any()
        eventually(lambda: server.instances(MODEL)[0].state == "READY", "restarted")
        fresh = client.sequence(MODEL)
        scores = [
            fresh.infer({"features": chunk}, end=i == 2)["scores"] for i, chunk in enumerate(second)
        ]
    for error in (lost, again):
        assert status(error)[0] == grpc.StatusCode.UNAVAILABLE, status(error)[1]
        assert "lost its state" in status(error)[1]
        assert "sequence_start" in status(error)[1]
    for served, expected in zip(scores, kws_reference(second), strict=True):
        np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-6)
    assert sequence_events(server, MODEL)["lost"] == 1


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl is not installed (dev extra)")
def test_a_sequence_through_grpcurl(server: ServerProcess) -> None:
    """Hand-written JSON requests with Triton's sequence parameters, as an operator would send
    them: each answer is the sequence's own."""
    frames = chunks(30, 3)
    answers = []
    for i, chunk in enumerate(frames):
        parameters = {
            "sequence_id": {"int64_param": "4242"},
            "sequence_start": {"bool_param": i == 0},
            "sequence_end": {"bool_param": i == len(frames) - 1},
        }
        request = {
            "model_name": MODEL,
            "parameters": parameters,
            "inputs": [
                {
                    "name": "features",
                    "datatype": "FP32",
                    "shape": [1, FRAMES, FEATURES],
                    "contents": {"fp32_contents": chunk.ravel().tolist()},
                }
            ],
        }
        response = json.loads(
            grpcurl_ok(server, "inference.GRPCInferenceService/ModelInfer", data=request)
        )
        (raw,) = response["raw_output_contents"]
        answers.append(np.frombuffer(base64.b64decode(raw), dtype="<f4").reshape(1, 12))
    for served, expected in zip(answers, kws_reference(frames), strict=True):
        np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def two_frontends(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    """`--frontends 2`, shared by the transports' variants (each ends its sequences)."""
    root = tmp_path_factory.mktemp("sequences-frontends")
    repository = model_repository(root / "models", [MODEL])
    args = ["--frontends", "2", "--certs-dir", str(certs_dir)]
    with running_server(repository, root / "log", args) as process:
        yield process


@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_sequences_through_two_frontends(
    two_frontends: ServerProcess, certs_dir: Path, transport: str
) -> None:
    """`--frontends 2`: a sequence's requests reach one scheduler whichever front-end each
    connection lands on, and interleaved sequences still answer as alone."""
    inputs = [chunks(40 + seed) for seed in range(COUNT)]
    server = two_frontends
    clients = [AsyncInferenceClient(**client_args(server, certs_dir, transport)) for _ in range(3)]
    try:
        # Each request of a sequence on the next client: connections spread over both
        # front-ends, and the sequence crosses them.
        async def run(frames: list[Array]) -> list[Array]:
            parameters = SequenceParameters()
            return [
                (
                    await clients[i % len(clients)].infer(
                        MODEL, {"features": c}, parameters=parameters.next(i == LENGTH - 1)
                    )
                )["scores"]
                for i, c in enumerate(frames)
            ]

        together = await asyncio.gather(*(run(frames) for frames in inputs))
    finally:
        for client in clients:
            await client.close()
    for frames, served in zip(inputs, together, strict=True):
        for a, b in zip(served, kws_reference(frames), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("transport", ["h2", "h3"])
def test_one_stream_carries_many_sequences_in_order_through_two_frontends(
    two_frontends: ServerProcess, certs_dir: Path, transport: str
) -> None:
    """The front-end holding the stream passes a sequence's requests on in the stream's
    part, where the parent keeps their order."""
    assert_one_stream_keeps_each_sequence_in_order(two_frontends, certs_dir, transport)


def test_a_reload_keeps_live_sequences_on_the_old_version(tmp_path: Path) -> None:
    """RepositoryModelLoad replaces kws while a sequence is live: that sequence goes on where
    its state is (the replaced version, winding down), a new one starts on the new version."""
    repository = tmp_path / "models"
    repository.mkdir()
    config = kws_copy(repository, MODEL)
    args = ["--model-control-mode", "explicit", "--load-model", MODEL, "--no-h3"]
    old, new = chunks(50, 4), chunks(51, 2)
    with running_server(repository, tmp_path / "log", args) as server:
        with InferenceClient(server.url) as client:
            live = client.sequence(MODEL)
            scores = [live.infer({"features": c})["scores"] for c in old[:2]]
            config.write_text(config.read_text() + "# reloaded\n")
            server.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL))
            fresh = client.sequence(MODEL)
            started = [fresh.infer({"features": c})["scores"] for c in new]
            scores += [
                live.infer({"features": c}, end=i == 1)["scores"] for i, c in enumerate(old[2:])
            ]
        # Its sequence ended: the replaced version winds down.
        eventually(
            lambda: "version 1 replaced; its workers stopped" in server.log_text(),
            "wound down",
        )
    for served, expected in zip(scores, kws_reference(old), strict=True):
        np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-6)
    for served, expected in zip(started, kws_reference(new), strict=True):
        np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-6)


async def sum_sequence(
    client: AsyncInferenceClient, values: list[int], corrid: int
) -> list[tuple[int, int]]:
    """(running total, worker pid) of each request of one running_sum sequence."""
    parameters = SequenceParameters(corrid)
    answers = []
    for i, value in enumerate(values):
        out = await client.infer(
            RUNNING_SUM,
            {"value": np.array([[value]], np.int64)},
            parameters=parameters.next(i == len(values) - 1),
        )
        answers.append((int(out["total"][0, 0]), int(out["pid"][0, 0])))
    return answers


async def test_a_model_that_keeps_its_own_state_gets_each_sequence_on_its_instance(
    server: ServerProcess,
) -> None:
    """running_sum keeps a sum per correlation id in its worker's memory, in two instances:
    every sequence's requests reach the worker that saw its start, in order (the sums are
    right), and the sequences spread over both instances."""
    sequences = {corrid: [corrid * 10 + i for i in range(4)] for corrid in range(1, 9)}
    async with AsyncInferenceClient(server.url) as client:
        answers = await asyncio.gather(
            *(sum_sequence(client, values, corrid) for corrid, values in sequences.items())
        )
    pids = set()
    for values, answer in zip(sequences.values(), answers, strict=True):
        assert [total for total, _ in answer] == list(itertools.accumulate(values))
        assert len({pid for _, pid in answer}) == 1, "a sequence moved between workers"
        pids.add(answer[0][1])
    assert pids == {i.pid for i in server.instances(RUNNING_SUM)}


def test_a_dead_instance_loses_only_its_own_sequences(server: ServerProcess) -> None:
    """One of running_sum's two workers dies: its sequences' next requests are UNAVAILABLE,
    the other instance's sequences go on with their sums intact."""
    with InferenceClient(server.url) as client:
        sequences = [client.sequence(RUNNING_SUM, sequence_id=100 + i) for i in range(4)]
        pids = []
        for sequence in sequences:
            out = sequence.infer({"value": np.array([[5]], np.int64)})
            pids.append(int(out["pid"][0, 0]))
        assert len(set(pids)) == 2  # placed on the least busy instance: both are used
        victim = pids[0]
        os.kill(victim, signal.SIGKILL)
        for sequence, pid in zip(sequences, pids, strict=True):
            if pid == victim:
                with pytest.raises(grpc.RpcError) as lost:
                    sequence.infer({"value": np.array([[1]], np.int64)}, end=True)
                code, details = status(lost)
                assert code == grpc.StatusCode.UNAVAILABLE and "lost its state" in details
            else:
                out = sequence.infer({"value": np.array([[1]], np.int64)}, end=True)
                assert int(out["total"][0, 0]) == 6 and int(out["pid"][0, 0]) == pid


def test_every_bucket_is_warmed_before_ready(server: ServerProcess) -> None:
    """Each batch-size bucket ran once per instance before READY (its engine built that
    shape's kernels); outside any sequence: the live-bound test counts SMALL's starts exactly."""
    warmed = re.search(rf"model {SMALL} version 1 warmed up: (\d+) inferences", server.log_text())
    assert warmed is not None and int(warmed.group(1)) > 1


def test_a_new_start_restarts_a_live_sequence_from_its_initial_state(server: ServerProcess) -> None:
    """sequence_start on an id that is still live starts it again: its answers are a fresh
    sequence's, not a continuation of the old state."""
    old, new = chunks(60, 2), chunks(61, 2)
    with InferenceClient(server.url) as client:
        first = client.sequence(MODEL, sequence_id=777)
        for chunk in old:
            first.infer({"features": chunk})
        again = client.sequence(MODEL, sequence_id=777)  # its first request starts it again
        scores = [
            again.infer({"features": c}, end=i == len(new) - 1)["scores"] for i, c in enumerate(new)
        ]
    for served, expected in zip(scores, kws_reference(new), strict=True):
        np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-6)
