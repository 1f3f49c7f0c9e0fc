"""Triton's image classification clients (`image_client.py` over REST and gRPC,
`grpc_image_client.py`) against `densenet_onnx`, the stand-in for Triton's example model of
that name (Triton's config, a DenseNet-121 of random weights, our own labels), exported on
demand by scripts/export_models.py and served with `--server-name triton`; and
`ensemble_image_client.py` against an ensemble of the shape it asks for (Triton's is gone):
tests/fixtures/image_preprocess decoding the files' bytes, then resnet18. Each client's steps
run in a process of their own (triton_image_check.py) on PNGs made here; the top classes they
get, as `score:index:label`, are the ones in-process Paddle ranks for the same pixels."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.reference import run_program
from tests.servers import (
    EXAMPLE_MODELS,
    HTTP_PORT,
    REPO_ROOT,
    ServerProcess,
    running_server,
)

SCRIPT = Path(__file__).with_name("triton_image_check.py")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODEL = "densenet_onnx"
ENSEMBLE = "preprocess_inception_ensemble"  # the name ensemble_image_client.py asks for
ENSEMBLE_LABELS = [f"label {i}" for i in range(1000)]
ENSEMBLE_CONFIG = f"""name: "{ENSEMBLE}"
platform: "ensemble"
max_batch_size: 16
input [ {{ name: "INPUT", data_type: TYPE_STRING, dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT", data_type: TYPE_FP32, dims: [ 1000 ], label_filename: "labels.txt" }} ]
ensemble_scheduling {{
  step [
    {{
      model_name: "image_preprocess", model_version: -1,
      input_map {{ key: "INPUT", value: "INPUT" }},
      output_map {{ key: "OUTPUT", value: "preprocessed_image" }}
    }},
    {{
      model_name: "resnet18", model_version: -1,
      input_map {{ key: "image", value: "preprocessed_image" }},
      output_map {{ key: "logits", value: "OUTPUT" }}
    }}
  ]
}}
"""
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
    args = ["--no-h3", "--server-name", "triton", "--http-port", HTTP_PORT]
    with running_server(repository, repository.parent / "server.log", args) as s:
        yield s, s.http_port


@pytest.fixture(scope="module")
def ensemble_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, int]]:
    root = tmp_path_factory.mktemp("ensemble-image")
    preprocess, classifier, ensemble = (
        root / "models" / name for name in ("image_preprocess", "resnet18", ENSEMBLE)
    )
    (preprocess / "1").mkdir(parents=True)
    shutil.copy(FIXTURES / "image_preprocess" / "config.pbtxt", preprocess / "config.pbtxt")
    shutil.copy(FIXTURES / "image_preprocess" / "model.py", preprocess / "1" / "model.py")
    classifier.mkdir()
    (classifier / "1").symlink_to(EXAMPLE_MODELS / "resnet18" / "1")
    shutil.copy(EXAMPLE_MODELS / "resnet18" / "config.pbtxt", classifier / "config.pbtxt")
    ensemble.mkdir()
    (ensemble / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    (ensemble / "labels.txt").write_text("".join(f"{label}\n" for label in ENSEMBLE_LABELS))
    args = ["--no-h3", "--server-name", "triton", "--http-port", HTTP_PORT]
    with running_server(root / "models", root / "server.log", args) as s:
        yield s, s.http_port


def picture(path: Path, height: int, width: int, seed: int) -> Path:
    """An RGB picture of another size than the model's (the clients resize it)."""
    rows, columns = np.mgrid[0:height, 0:width]
    noise = np.random.default_rng(seed).integers(0, 256, (height, width))
    pixels = np.stack([columns * 255 // (width - 1), rows * 255 // (height - 1), noise], axis=-1)
    Image.fromarray(pixels.astype(np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return picture(tmp_path_factory.mktemp("image") / "picture.png", 300, 400, 11)


def check(command: list[str]) -> Any:
    """Run triton_image_check.py; what it printed."""
    command = [sys.executable, str(SCRIPT), *command, "--classes", str(CLASSES)]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def expected_classes(logits: np.ndarray[Any, Any], labels: list[str]) -> list[list[str]]:
    """The top CLASSES as Triton answers them: best first, equal scores in index order."""
    order = sorted(range(logits.size), key=lambda i: (-logits[i], i))[:CLASSES]
    return [[f"{logits[i]:f}", str(i), labels[i]] for i in order]


def assert_classes(served: list[list[str]], expected: list[list[str]]) -> None:
    """The same classes in the same order; the scores as printed, within Paddle's rounding."""
    assert [row[1:] for row in served] == [row[1:] for row in expected]
    np.testing.assert_allclose(
        [float(row[0]) for row in served], [float(row[0]) for row in expected], rtol=1e-4
    )


def inception_pixels(path: Path) -> np.ndarray[Any, Any]:
    """What image_preprocess makes of a file (the reference's own arithmetic): RGB, bilinear
    224x224, [-1, 1], NCHW."""
    image = Image.open(path).convert("RGB").resize((224, 224), Image.Resampling.BILINEAR)
    scaled = np.asarray(image).astype(np.float32) / 127.5 - 1
    return np.transpose(scaled, (2, 0, 1))


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
    arguments = ["--protocol", client, "--url", url, "--image", str(image)]
    served = check([*arguments, "--scaling", scaling, "--sent", str(sent)])["classes"]

    tensor = np.load(sent)
    assert tensor.shape == (3, 224, 224)  # NCHW, as the config's format says
    (logits,) = run_program(MODEL, {"data_0": tensor.reshape(1, 3, 224, 224)}, 1, repository)
    assert logits.shape == (1, 1000, 1, 1)  # the config's reshape: clients see [1000]
    labels = (repository / MODEL / "densenet_labels.txt").read_text().splitlines()
    assert_classes(served, expected_classes(logits.reshape(-1), labels))


@pytest.mark.parametrize("protocol", ["ensemble_http", "ensemble_grpc"])
def test_tritons_ensemble_image_client_gets_paddles_top_classes(
    ensemble_server: tuple[ServerProcess, int], tmp_path: Path, protocol: str
) -> None:
    """ensemble_image_client.py (`-i http`, `-i grpc`) `-c 3` on a folder of two PNGs: one
    request of both files' bytes, each answered with its top classes of the ensemble's
    output, labelled by the ensemble's label_filename."""
    grpc, http_port = ensemble_server
    url = f"127.0.0.1:{http_port}" if protocol == "ensemble_http" else grpc.address
    files = [picture(tmp_path / "b.png", 180, 240, 5), picture(tmp_path / "a.png", 300, 400, 11)]
    served = check(
        ["--protocol", protocol, "--url", url, "--model", ENSEMBLE, "--image"]
        + [str(f) for f in files]
    )["outputs"]
    assert list(served) == ["OUTPUT"]

    batch = np.stack([inception_pixels(f) for f in sorted(files)])
    (logits,) = run_program("resnet18", {"image": batch})
    assert len(served["OUTPUT"]) == len(files)
    for row, expected in zip(served["OUTPUT"], logits, strict=True):
        assert_classes(row, expected_classes(expected, ENSEMBLE_LABELS))


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


def test_export_again_restores_a_missing_label_file_and_keeps_the_weights(
    repository: Path, tmp_path: Path
) -> None:
    """A model already exported is not exported again, but the files beside its config are
    made as the script writes them."""
    copy = tmp_path / "models" / MODEL
    shutil.copytree(repository / MODEL, copy)
    (copy / "densenet_labels.txt").unlink()
    weights = (copy / "1" / "inference.pdiparams").stat().st_mtime_ns
    command = [
        sys.executable,
        "scripts/export_models.py",
        "--out",
        str(copy.parent),
        "--only",
        MODEL,
    ]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=EXPORT_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    assert "weights kept, densenet_labels.txt updated" in done.stdout
    labels = repository / MODEL / "densenet_labels.txt"
    assert (copy / "densenet_labels.txt").read_text() == labels.read_text()
    assert (copy / "1" / "inference.pdiparams").stat().st_mtime_ns == weights
