"""What one worker process runs and where: the model's files and parameters, and the device,
environment and limits placement and the model's config gave it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from service.model.files import PYTHON_BACKEND, ModelFiles
from service.model.shapes import ShapeBuckets


@dataclass
class WorkerSpec:
    """What a worker runs and where; placement fills device and environment."""

    instance_name: str
    model_name: str
    files: ModelFiles
    parameters: Mapping[str, str]
    device: str = "cpu"  # what the worker's predictor uses: "cpu" or "gpu"
    env: Mapping[str, str] = field(default_factory=dict)
    numa_node: int = -1
    label: str = "cpu"  # where placement put it, for people
    execution_timeout_s: float | None = None  # the watchdog's limit per batch; None: none
    shapes: ShapeBuckets = field(default_factory=ShapeBuckets)
    backend: str = ""  # "python" for a model.py; otherwise Paddle
    config: bytes = b""  # the serialized ModelConfig, for Python models
    decoupled: bool = False  # answers through Responses (streams.py), not Results
    max_message_bytes: int = 64 << 20  # the server's --max-message-bytes (message_bounds.py)
    preloaded: bool = True  # a Paddle CPU worker: forked by the preloaded launcher
    # Forked from its version's model template (templates.py), which built the predictor its
    # instances share: a preloaded worker of a version with more instances than one.
    template: bool = False

    @property
    def python(self) -> bool:
        return self.backend == PYTHON_BACKEND
