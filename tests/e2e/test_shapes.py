"""Shape buckets, warm-up and engine options on a real server: batches padded to buckets answer
each request with exactly its rows, sequence buckets pad with the configured value, every bucket
and the model_warmup samples run before READY, and a sample or an engine option that cannot run
leaves that model UNAVAILABLE with the reason while the rest serve."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.e2e.test_watchdog import parameter
from tests.reference import assert_matches_reference, call_inputs, output_names, run_reference
from tests.servers import EXAMPLE_MODELS, ServerProcess, gather_held, running_server

pytestmark = pytest.mark.e2e
RPC_TIMEOUT_S = 120.0
REQUESTS = 5  # of 3 rows each: no batch of them (3 to 15 rows) is a bucket's size
MLP = """
max_batch_size: 64
input [ { name: "input", data_type: TYPE_FP32, dims: [ 256 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
dynamic_batching { }
"""
SAMPLE = """
model_warmup [ {
  name: "noise" batch_size: BATCH count: 2
  inputs { key: "input" value: { data_type: TYPE_FP32, dims: [ 256 ], random_data: true } }
} ]
"""
TEXT = """
max_batch_size: 8
input [ { name: "token_ids", data_type: TYPE_INT64, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
dynamic_batching { }
"""


def add_model(root: Path, name: str, source: str, config: str) -> None:
    model = root / name
    model.mkdir(parents=True)
    (model / "1").symlink_to(EXAMPLE_MODELS / source / "1")
    (model / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("shapes")
    models = root / "models"
    # The example's output name, so that responses compare with the reference's.
    named = (
        f'output [ {{ name: "{output_names("mlp")[0]}", data_type: TYPE_FP32, dims: [ 10 ] }} ]\n'
    )
    add_model(models, "mlp", "mlp", MLP + named + SAMPLE.replace("BATCH", "5"))
    text = TEXT + parameter("sequence_buckets", "8,16") + parameter("sequence_pad_value", "3")
    add_model(models, "text", "text_classifier", text)
    add_model(models, "bad_warmup", "mlp", MLP + SAMPLE.replace("BATCH", "65"))
    add_model(models, "bad_engine", "mlp", MLP + parameter("memory_optim", "true"))
    with running_server(models, root / "server.log", wait=False) as process:
        process.wait_loaded()
        yield process


def test_every_bucket_and_the_samples_run_before_ready(server: ServerProcess) -> None:
    log = server.log_text()
    assert "model mlp version 1 warmed up: 9 inferences (7 buckets, model_warmup 'noise' x2)" in log
    assert "model text version 1 warmed up: 8 inferences (8 buckets)" in log
    stats = server.stub.ModelStatistics(pb.ModelStatisticsRequest(name="mlp"), timeout=10)
    assert stats.model_stats[0].execution_count == 0  # warm-up is not counted


async def test_padded_batches_answer_each_request_with_its_rows(server: ServerProcess) -> None:
    """Requests of 3 rows each, held until all arrived: any batch of them runs padded to a
    bucket, and each request gets the answer for its own rows."""
    inputs = [call_inputs("mlp", call) for call in range(REQUESTS)]
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelInfer(build_request("mlp", x), timeout=RPC_TIMEOUT_S) for x in inputs]
        responses = await gather_held(server, "mlp", calls)
    for x, response in zip(inputs, responses, strict=True):
        assert_matches_reference("mlp", x, response)
    stats = server.stub.ModelStatistics(pb.ModelStatisticsRequest(name="mlp"), timeout=10)
    # Statistics count the rows requests brought (the engine ran them padded to a bucket).
    sizes = {b.batch_size: b.compute_infer.count for b in stats.model_stats[0].batch_stats}
    assert sum(size * count for size, count in sizes.items()) == 3 * REQUESTS
    assert all(size % 3 == 0 for size in sizes) and max(sizes) > 3, sizes


def test_sequence_buckets_pad_with_the_configured_value(server: ServerProcess) -> None:
    ids = np.random.default_rng(4).integers(5, 1000, (2, 5), dtype=np.int64)
    response = server.stub.ModelInfer(build_request("text", {"token_ids": ids}), timeout=60)
    (served,) = parse_response(response).values()
    padded = np.full((2, 8), 3, np.int64)
    padded[:, :5] = ids
    (expected,) = run_reference("text_classifier", {"token_ids": padded}).values()
    assert served.shape == (2, 4)
    np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-5)


def test_models_that_cannot_warm_up_or_configure_are_unavailable(server: ServerProcess) -> None:
    index = server.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10).models
    states = {m.name: m for m in index}
    assert states["bad_warmup"].state == "UNAVAILABLE"
    assert "model_warmup 'noise': batch_size must be 1..64" in states["bad_warmup"].reason
    assert states["bad_engine"].state == "UNAVAILABLE"
    assert "memory_optim is not available for Paddle 3 (.json) programs" in (
        states["bad_engine"].reason
    )
    assert states["mlp"].state == states["text"].state == "READY"
