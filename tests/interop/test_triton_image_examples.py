"""Triton's image classification clients (`image_client.py` over REST and gRPC,
`grpc_image_client.py`) against `densenet_onnx`, the stand-in for Triton's example model of
that name (Triton's config, a DenseNet-121 of random weights, our own labels), exported on
demand by scripts/export_models.py and served with `--server-name triton`. Each client's steps
run in a process of their own (triton_image_check.py) on a PNG made here; the top classes
they get, as `score:index:label`, are the ones in-process Paddle ranks for the tensor they
sent."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.reference import run_program
from tests.servers import REPO_ROOT, ServerProcess, free_port, running_server

SCRIPT = Path(__file__).with_name("triton_image_check.py")
MODEL = "densenet_onnx"
CLASSES = 3
EXPORT_TIMEOUT_S = 600
CHECK_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models = tmp_path_factory.mktemp("image-examples") / "models"
    command = [sys.executable, "scripts/export_models.py", "--out", str(models), "--only", MODEL]
    subprocess.run(command, cwd=REPO_ROOT, check=True, timeout=EXPORT_TIMEOUT_S)
    return models


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[tuple[ServerProcess, int]]:
    http_port = free_port()
    args = ["--no-h3", "--server-name", "triton", "--http-port", str(http_port)]
    with running_server(repository, repository.parent / "server.log", args) as s:
        yield s, http_port


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An RGB picture of another size than the model's (the clients resize it)."""
    rows, columns = np.mgrid[0:300, 0:400]
    noise = np.random.default_rng(11).integers(0, 256, (300, 400))
    pixels = np.stack([columns * 255 // 399, rows * 255 // 299, noise], axis=-1)
    path = tmp_path_factory.mktemp("image") / "picture.png"
    Image.fromarray(pixels.astype(np.uint8)).save(path)
    return path


def expected_classes(logits: np.ndarray[Any, Any], labels: list[str]) -> list[list[str]]:
    """The top CLASSES as Triton answers them: best first, equal scores in index order."""
    order = sorted(range(logits.size), key=lambda i: (-logits[i], i))[:CLASSES]
    return [[f"{logits[i]:f}", str(i), labels[i]] for i in order]


@pytest.mark.parametrize(
    ("client", "scaling"),
    [("http", "INCEPTION"), ("grpc", "VGG"), ("grpc_raw", "INCEPTION"), ("grpc_raw", "NONE")],
)
def test_tritons_image_client_gets_paddles_top_classes(
    server: tuple[ServerProcess, int],
    repository: Path,
    image: Path,
    tmp_path: Path,
    client: str,
    scaling: str,
) -> None:
    """image_client.py (`-i http`, `-i grpc`) and grpc_image_client.py, `-c 3 -s SCALING`."""
    grpc, http_port = server
    url = f"127.0.0.1:{http_port}" if client == "http" else grpc.address
    sent = tmp_path / "sent.npy"
    command = [sys.executable, str(SCRIPT), "--protocol", client, "--url", url]
    command += ["--image", str(image), "--scaling", scaling, "--classes", str(CLASSES)]
    command += ["--sent", str(sent)]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout + done.stderr
    served = json.loads(done.stdout)["classes"]

    tensor = np.load(sent)
    assert tensor.shape == (3, 224, 224)  # NCHW, as the config's format says
    (logits,) = run_program(MODEL, {"data_0": tensor.reshape(1, 3, 224, 224)}, 1, repository)
    assert logits.shape == (1, 1000, 1, 1)  # the config's reshape: clients see [1000]
    labels = (repository / MODEL / "densenet_labels.txt").read_text().splitlines()
    expected = expected_classes(logits.reshape(-1), labels)
    assert [row[1:] for row in served] == [row[1:] for row in expected]
    np.testing.assert_allclose(
        [float(row[0]) for row in served], [float(row[0]) for row in expected], rtol=1e-4
    )


def test_export_writes_tritons_config_and_a_label_a_class(repository: Path) -> None:
    config = (repository / MODEL / "config.pbtxt").read_text()
    for field in (
        "format: FORMAT_NCHW",
        "reshape { shape: [ 1, 1000, 1, 1 ] }",
        "max_batch_size: 0",
    ):
        assert field in config
    labels = (repository / MODEL / "densenet_labels.txt").read_text().splitlines()
    assert len(labels) == 1000 and len(set(labels)) == 1000
    assert not any(":" in label for label in labels)  # the answer's separator
