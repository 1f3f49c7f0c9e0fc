"""Decoupled models (Triton's `model_transaction_policy { decoupled: true }`): a model that
answers each request with zero to many responses, through ModelStreamInfer only. What its
config may say is checked when it is read; how many of its requests run at once is a
parameter (each holds a place in its model for as long as it generates)."""

from __future__ import annotations

from dataclasses import dataclass

from protos.inference import model_config_pb2 as mc
from service.model.files import ENSEMBLE, PYTHON_BACKEND
from service.model.parameters import FALLBACK_MODEL, string_parameters

MAX_CONCURRENT = "max_concurrent_requests"
MAX_QUEUED = "max_queued_requests"
DEFAULT_CONCURRENT = 64
DEFAULT_QUEUED = 256


@dataclass(frozen=True)
class StreamLimits:
    concurrent: int  # requests of one version generating at once
    queued: int  # more than that wait, in arrival order, up to this many; beyond: refused


def is_decoupled(config: mc.ModelConfig) -> bool:
    return config.model_transaction_policy.decoupled


def refusal(config: mc.ModelConfig) -> str | None:
    """Why this decoupled config cannot be served, or None (also None when not decoupled)."""
    if not is_decoupled(config):
        return None
    if config.platform == ENSEMBLE:
        return "an ensemble cannot be decoupled (its steps answer one response each)"
    if config.backend != PYTHON_BACKEND:
        return (
            "a Paddle model cannot be decoupled: model_transaction_policy { decoupled: true } "
            f'needs backend: "{PYTHON_BACKEND}" (a model.py that sends its responses)'
        )
    if config.HasField("dynamic_batching"):
        return (
            "a decoupled model gets its requests one at a time (batch decode steps inside "
            "the model); remove dynamic_batching"
        )
    if config.model_warmup:
        return "model_warmup is not run for decoupled models; remove it"
    if string_parameters(config).get(FALLBACK_MODEL, "").strip():
        return f"a decoupled model cannot have a {FALLBACK_MODEL}"
    return None


def stream_limits(config: mc.ModelConfig) -> StreamLimits:
    """The config was checked when read (parameters.py bounds both numbers)."""
    params = string_parameters(config)
    return StreamLimits(
        int(params.get(MAX_CONCURRENT, DEFAULT_CONCURRENT)),
        int(params.get(MAX_QUEUED, DEFAULT_QUEUED)),
    )
