"""Triton's config fields that only tune Triton's own engines (TensorRT profiles, CUDA graphs,
pinned memory, rate limiting, its response cache, ...): accepted so that Triton's configs load
unchanged, named in a warning at load (nothing here applies them) and answered back as written
by ModelConfig. Fields that change what a model receives or returns and that paddlequic does
not implement are refused instead, so that no model silently computes something else."""

from __future__ import annotations

from google.protobuf.message import Message

from protos.inference import model_config_pb2 as mc

# (message, field) pairs whose value paddlequic reads nowhere.
_TUNING: frozenset[tuple[str, str]] = frozenset(
    {
        ("ModelConfig", "runtime"),
        ("ModelConfig", "optimization"),
        ("ModelConfig", "default_model_filename"),
        ("ModelConfig", "cc_model_filenames"),
        ("ModelConfig", "metric_tags"),
        ("ModelConfig", "model_operations"),
        ("ModelConfig", "model_repository_agents"),
        ("ModelConfig", "response_cache"),
        ("ModelConfig", "model_metrics"),
        ("ModelInstanceGroup", "rate_limiter"),
        ("ModelInstanceGroup", "secondary_devices"),
        ("ModelInstanceGroup", "profile"),
        ("ModelInstanceGroup", "passive"),
        ("ModelInstanceGroup", "host_policy"),
        ("ModelInput", "is_shape_tensor"),
        ("ModelInput", "allow_ragged_batch"),
        ("ModelInput", "is_non_linear_format_io"),
        ("ModelOutput", "is_shape_tensor"),
        ("ModelOutput", "is_non_linear_format_io"),
        ("ModelEnsembling", "max_inflight_requests"),
        ("Step", "model_namespace"),
    }
)

# Fields that would change a model's tensors; the text says why they are refused.
_UNSERVED = {
    "batch_input": "batch_input (tensors a Triton backend adds to a batch) is not implemented",
    "batch_output": "batch_output (outputs a Triton backend scatters) is not implemented",
}


def tuning_fields(config: mc.ModelConfig) -> list[str]:
    """The tuning fields `config` sets, as paths (`input[0].allow_ragged_batch`), sorted."""
    return sorted(_walk(config, ""))


_IMAGE_FORMATS = (mc.ModelInput.FORMAT_NHWC, mc.ModelInput.FORMAT_NCHW)


def unserved(config: mc.ModelConfig) -> str | None:
    """Why `config` cannot be served as written, or None."""
    for field, why in _UNSERVED.items():
        if getattr(config, field):
            return f"{why}; remove {field}"
    for tensor in config.input:  # Triton's check, in its words (an image is CHW or HWC)
        if tensor.format in _IMAGE_FORMATS and len(tensor.dims) != 3:
            return (
                f"model input NHWC/NCHW require 3 dims (input {tensor.name!r} has "
                f"{len(tensor.dims)})"
            )
    return None


def _walk(message: Message, prefix: str) -> list[str]:
    found: list[str] = []
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        if (message.DESCRIPTOR.name, field.name) in _TUNING:
            found.append(path)
        elif field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        elif field.is_repeated:
            for i, item in enumerate(value):
                found += _walk(item, f"{path}[{i}].")
        else:
            found += _walk(value, f"{path}.")
    return found
