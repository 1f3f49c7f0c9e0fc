"""What is checked across models once they are loaded: an ensemble's steps against their
models, a model against its fallback model. Either can be loaded first, so both are checked
after every load; a version that fails a check fails (Lifecycle.fail)."""

from __future__ import annotations

from service.inference import errors
from service.lifecycle.retiring import Fail
from service.model import ensemble
from service.model.decoupled import is_decoupled
from service.model.parameters import check_parameters
from service.registry.versions import ModelRegistry, VersionState
from service.resilience.fallback import incompatibility


async def check_ensembles(registry: ModelRegistry, fail: Fail) -> None:
    """Fail every ensemble a served step model cannot run (a step model not loaded yet
    only keeps the ensemble not ready)."""
    for served in registry.all_versions():
        if not served.steps or served.state is not VersionState.READY:
            continue
        for step in served.steps:
            try:
                model = registry.resolve(step.model, step.version)
            except errors.ServiceError:
                continue
            if model.steps:
                reason: str | None = (
                    f"{step.describe()} is an ensemble itself; ensembles do not nest"
                )
            elif is_decoupled(model.config):
                reason = (
                    f"{step.describe()} is decoupled (it answers through ModelStreamInfer "
                    "with many responses); an ensemble step must answer once"
                )
            else:
                reason = ensemble.check_step(step, served.config, model.config)
            if reason is not None:
                await fail(served, reason, "ensemble")
                break


async def check_fallbacks(registry: ModelRegistry, fail: Fail) -> None:
    """Fail every ready version whose fallback model is served but does not take its
    inputs or give its outputs (checked once both are loaded, whichever came first)."""
    for served in registry.all_versions():
        name = check_parameters(served.config).fallback_model
        if name is None or served.state is not VersionState.READY:
            continue
        ready = [v for v in registry.serving(name).values() if v.state is VersionState.READY]
        reason = next((r for v in ready if (r := incompatibility(served.config, v.config))), None)
        if reason is not None:
            await fail(served, f"fallback_model '{name}' {reason}", "fallback")
