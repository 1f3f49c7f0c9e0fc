"""The message that tells a worker which model to load and how; what the backends read."""

from __future__ import annotations

from dataclasses import dataclass

from service.model.shapes import ShapeBuckets


@dataclass(frozen=True)
class Load:
    """First message to a new worker: what to load and how."""

    model_name: str
    version: int
    model_file: str
    params_file: str
    parameters: dict[str, str]
    device: str
    shapes: ShapeBuckets  # the engine's shape cache and TensorRT's shape range follow them
    backend: str = ""  # "python": model_file is a model.py; otherwise a Paddle program
    config: bytes = b""  # the serialized ModelConfig (Python models are told it)
    # The server's --max-message-bytes: what one caller may receive, so what one decoupled
    # response or BLS call may carry (service/workers/message_bounds.py).
    max_message_bytes: int = 64 << 20
