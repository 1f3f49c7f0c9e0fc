"""Whether a fallback model can answer another model's requests: every request the primary
accepts must be valid for it, and it must give every output the primary's callers may ask for,
with the same datatypes and shapes."""

from __future__ import annotations

from oip.datatypes import config_type_name
from protos.inference import model_config_pb2 as mc


def incompatibility(primary: mc.ModelConfig, fallback: mc.ModelConfig) -> str | None:
    """Why `fallback` cannot stand in for `primary`, or None when it can."""
    if fallback.model_transaction_policy.decoupled:
        return "is decoupled (it answers with many responses, this model with one)"
    if (primary.max_batch_size > 0) != (fallback.max_batch_size > 0):
        return "does not batch as this model does (max_batch_size 0 on one side only)"
    if fallback.max_batch_size < primary.max_batch_size:
        return (
            f"takes batches of at most {fallback.max_batch_size}, this model "
            f"{primary.max_batch_size}"
        )
    for kind, ours, theirs in (
        ("input", primary.input, fallback.input),
        ("output", primary.output, fallback.output),
    ):
        by_name = {t.name: t for t in theirs}
        for tensor in ours:
            other = by_name.get(tensor.name)
            if other is None:
                return f"has no {kind} '{tensor.name}'"
            if other.data_type != tensor.data_type or list(other.dims) != list(tensor.dims):
                return (
                    f"declares {kind} '{tensor.name}' as "
                    f"{_describe(other)}, this model as {_describe(tensor)}"
                )
    if len(fallback.input) != len(primary.input):
        extra = sorted({t.name for t in fallback.input} - {t.name for t in primary.input})
        return f"needs input(s) {extra} that this model's callers do not send"
    return None


def _describe(tensor: mc.ModelInput | mc.ModelOutput) -> str:
    return f"{config_type_name(tensor.data_type).removeprefix('TYPE_')}{list(tensor.dims)}"
