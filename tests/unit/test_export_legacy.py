"""`scripts/export_models.py --legacy`: legacy programs (inference.pdmodel), the format the GPU
build on PyPI reads, which this Paddle serves too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from service.backend.load import Load
from service.backend.paddle_model import PaddleModel
from service.model.shapes import ShapeBuckets
from tests.servers import REPO_ROOT


def test_legacy_export_writes_a_pdmodel_that_serves(tmp_path: Path) -> None:
    command = [sys.executable, "scripts/export_models.py", "--out", str(tmp_path), "--legacy"]
    done = subprocess.run(
        [*command, "--only", "mlp", "text_classifier"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert "text_classifier ... skipped (no legacy export)" in done.stdout
    version = tmp_path / "mlp" / "1"
    assert sorted(p.name for p in version.iterdir() if p.suffix != ".info") == [
        "inference.pdiparams",
        "inference.pdmodel",
    ]
    assert not (tmp_path / "text_classifier").exists()
    files = (str(version / "inference.pdmodel"), str(version / "inference.pdiparams"))
    model = PaddleModel(Load("mlp", 1, *files, {}, "cpu", ShapeBuckets()))
    assert [(t.name, t.datatype, t.shape) for t in model.inputs] == [("input", "FP32", (-1, 256))]
    outputs, _ = model.run({"input": np.ones((3, 256), np.float32)}, (model.outputs[0].name,))
    (probabilities,) = outputs.values()
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
