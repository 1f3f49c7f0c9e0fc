"""The classification extension end to end: a copy of the example mlp with a label file
(`label_filename`), asked for its top 3 by tritonclient's real gRPC client and by ours over
HTTP/2 and HTTP/3, answers Triton's BYTES `score:index:label`, best first; and a copy with
`reshape` on its input and output (clients see `dims`, the model its own shape)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import AsyncInferenceClient, build_request
from oip.bytes_tensor import deserialize_bytes
from protos.inference import grpc_service_pb2 as pb
from tests.servers import EXAMPLE_MODELS, REPO_ROOT, ServerProcess, client_args, running_server

SCRIPT = Path(__file__).with_name("tritonclient_classification_check.py")
LABELS = [f"digit-{i}" for i in range(10)]
CONFIG = (EXAMPLE_MODELS / "mlp" / "config.pbtxt").read_text().replace('"mlp"', '"mlp_labels"')


def _top(probabilities: list[float], k: int) -> list[str]:
    order = sorted(range(len(probabilities)), key=lambda i: -probabilities[i])[:k]
    return [f"{probabilities[i]:f}:{i}:{LABELS[i]}" for i in order]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("classification")
    model = root / "models" / "mlp_labels"
    model.mkdir(parents=True)
    (model / "1").symlink_to(EXAMPLE_MODELS / "mlp" / "1")
    (model / "labels.txt").write_text("".join(f"{label}\n" for label in LABELS))
    (model / "config.pbtxt").write_text(
        CONFIG.replace("dims: [ 10 ]", 'dims: [ 10 ], label_filename: "labels.txt"')
        + "response_cache { enable: true }\n"
    )
    reshaped = root / "models" / "mlp_reshaped"
    reshaped.mkdir()
    (reshaped / "1").symlink_to(EXAMPLE_MODELS / "mlp" / "1")
    (reshaped / "config.pbtxt").write_text(
        CONFIG.replace('"mlp_labels"', '"mlp_reshaped"')
        .replace("dims: [ 256 ]", "dims: [ 16, 16 ], reshape { shape: [ 256 ] }")
        .replace("dims: [ 10 ]", "dims: [ 2, 5 ], reshape { shape: [ 10 ] }")
    )
    with running_server(root / "models", root / "log", ["--certs-dir", str(certs_dir)]) as s:
        yield s


def test_tritonclient_class_count_answers_top_k_with_labels(server: ServerProcess) -> None:
    command = [sys.executable, str(SCRIPT), "--url", server.address]
    finished = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert finished.returncode == 0, finished.stderr
    summary = json.loads(finished.stdout)
    assert summary["datatype"] == "BYTES"
    assert summary["top"] == [_top(row, 3) for row in summary["probabilities"]]
    assert "classification" in summary["extensions"]


def test_model_config_answers_the_fields_as_written_and_the_load_names_the_tuning_ones(
    server: ServerProcess,
) -> None:
    config = server.stub.ModelConfig(pb.ModelConfigRequest(name="mlp_labels"), timeout=30).config
    assert config.output[0].label_filename == "labels.txt"
    assert config.response_cache.enable
    assert (
        "model mlp_labels: config fields that tune Triton's own engines are accepted and not "
        "applied here: response_cache"
    ) in server.log_text()


@pytest.mark.parametrize("transport", ["h2", "h3"])
def test_class_count_on_both_transports(
    server: ServerProcess, certs_dir: Path, transport: str
) -> None:
    batch = np.random.default_rng(3).standard_normal((3, 256)).astype(np.float32)

    async def call() -> tuple[pb.ModelInferResponse, pb.ModelInferResponse]:
        async with AsyncInferenceClient(**client_args(server, certs_dir, transport)) as client:
            ranked = build_request("mlp_labels", {"input": batch}, ["probabilities"])
            ranked.outputs[0].parameters["classification"].int64_param = 4
            plain = build_request("mlp_labels", {"input": batch})
            return (
                await client.stub.ModelInfer(ranked, timeout=60),
                await client.stub.ModelInfer(plain, timeout=60),
            )

    ranked, plain = asyncio.run(call())
    (tensor,) = ranked.outputs
    assert (tensor.datatype, list(tensor.shape)) == ("BYTES", [3, 4])
    probabilities = np.frombuffer(plain.raw_output_contents[0], np.float32).reshape(3, 10)
    texts = [t.decode() for t in deserialize_bytes(ranked.raw_output_contents[0], 12)]
    assert texts == [t for row in probabilities.tolist() for t in _top(row, 4)]


def test_unranked_class_count_refused_as_triton(server: ServerProcess) -> None:
    request = build_request("mlp_labels", {"input": np.zeros((1, 256), np.float32)})
    request.outputs.add(name="probabilities").parameters["classification"].int64_param = -1
    with pytest.raises(grpc.RpcError) as refused:
        server.stub.ModelInfer(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid value for 'classification' parameter, expected >= 0" in str(
        refused.value.details()
    )


@pytest.mark.parametrize("transport", ["h2", "h3"])
def test_reshape_clients_send_and_get_dims_the_model_sees_its_shape(
    server: ServerProcess, certs_dir: Path, transport: str
) -> None:
    batch = np.random.default_rng(5).standard_normal((3, 256)).astype(np.float32)

    async def call() -> tuple[pb.ModelInferResponse, pb.ModelInferResponse]:
        async with AsyncInferenceClient(**client_args(server, certs_dir, transport)) as client:
            plain = build_request("mlp_labels", {"input": batch})
            shaped = build_request("mlp_reshaped", {"input": batch.reshape(3, 16, 16)})
            return (
                await client.stub.ModelInfer(plain, timeout=60),
                await client.stub.ModelInfer(shaped, timeout=60),
            )

    plain, shaped = asyncio.run(call())
    assert list(shaped.outputs[0].shape) == [3, 2, 5]
    assert shaped.raw_output_contents[0] == plain.raw_output_contents[0]
    metadata = server.stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp_reshaped"))
    assert [list(t.shape) for t in (*metadata.inputs, *metadata.outputs)] == [
        [-1, 16, 16],
        [-1, 2, 5],
    ]
