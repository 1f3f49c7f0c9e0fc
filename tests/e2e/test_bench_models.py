"""The models the benchmarks bring for hosts without Paddle serve what they promise: mlp_numpy
(`make bench-scale` on a many-core host, scripts/bench_scale_host.sh) is mlp's interface with
numpy's arithmetic, batched like any model; and bench-scale's stream load ends."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from scripts.bench_scale import BENCH_MODELS, open_channel, stream_loop
from tests.servers import ServerProcess, paused, running_server


def expected(rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The model's own arithmetic, from the seed it draws its weights with."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((256, 128), np.float32) / 16
    w2 = rng.standard_normal((128, 10), np.float32) / 11
    logits = np.maximum(rows @ w1, 0) @ w2
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities: np.ndarray[Any, Any] = shifted / shifted.sum(axis=1, keepdims=True)
    return probabilities


def test_mlp_numpy_has_mlps_interface_and_answers_every_row(tmp_path: Path) -> None:
    """With --frontends 2 its calls are served with the parent held still: the instance
    queues take it, so a host without Paddle measures the new path too."""
    repository = tmp_path / "models"
    shutil.copytree(BENCH_MODELS / "mlp_numpy", repository / "mlp_numpy")
    rows = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    args = ["--frontends", "2", "--no-h3"]
    with running_server(repository, tmp_path / "server.log", args) as server:
        metadata = server.stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp_numpy"), timeout=30)
        assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
            ("input", "FP32", [-1, 256])
        ]
        request = build_request("mlp_numpy", {"input": rows})
        first = parse_response(server.stub.ModelInfer(request, timeout=60))["probabilities"]
        with paused(server.process.pid):
            response = server.stub.ModelInfer(request, timeout=60)
        probabilities = parse_response(response)["probabilities"]
    np.testing.assert_array_equal(probabilities, first)
    assert probabilities.dtype == np.float32
    assert probabilities.shape == (3, 10)
    np.testing.assert_allclose(probabilities, expected(rows), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)


async def test_bench_scale_s_stream_loop_answers_every_request_and_ends(
    server: ServerProcess,
) -> None:
    """`make bench-scale`'s ModelStreamInfer load: requests kept in flight on one stream, the
    next written as an answer comes, and the stream closed once the time is up and every
    request was answered (a stream left open would hang the measurement)."""
    request = build_request("mlp", {"input": np.ones((1, 256), np.float32)})
    channel = open_channel("h2", server.port, "")
    try:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answered = await asyncio.wait_for(stream_loop(stub, request, 4, 0.3), 60)
    finally:
        await channel.close()
    assert answered >= 4
