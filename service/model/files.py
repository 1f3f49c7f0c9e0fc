"""Which files one model version is served from, and the kinds of model there are."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PLATFORM = "paddle_inference"


ENSEMBLE = "ensemble"  # steps of other models; no files of its own


@dataclass(frozen=True)
class ModelFiles:
    """One numeric version directory and the Paddle files in it (a Python model: both are
    its model.py; an ensemble, which has no files, all three are the model's directory)."""

    version: int
    path: Path
    model_file: Path
    params_file: Path


# config.pbtxt's `backend` of a model.py implementing Triton's TritonPythonModel (the other
# models are Paddle programs).
PYTHON_BACKEND = "python"
