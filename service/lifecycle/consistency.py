"""What is checked across models once they are loaded: an ensemble's steps against their
models (and that no ensemble reaches itself through them), a model against its fallback
model. Either can be loaded first, so both are checked after every load; a version that fails
a check fails (Lifecycle.fail)."""

from __future__ import annotations

from service.inference import errors
from service.lifecycle.retiring import Fail
from service.model import ensemble
from service.model.parameters import check_parameters
from service.registry.versions import ModelRegistry, ServedVersion, VersionState
from service.resilience.fallback import incompatibility


async def check_ensembles(registry: ModelRegistry, fail: Fail) -> None:
    """Fail every ensemble that reaches itself through its steps (each with its path), and
    every ensemble a served step model cannot run (a step model not loaded yet only keeps
    the ensemble not ready)."""
    ready = [v for v in registry.all_versions() if v.steps and v.state is VersionState.READY]
    steps: dict[str, set[str]] = {}
    for served in ready:  # taken before any fails: each ensemble on a cycle names it
        steps.setdefault(served.name, set()).update(s.model for s in served.steps)
    for served in ready:
        if served.state is not VersionState.READY:  # unloaded while a failure wound down
            continue
        cycle = ensemble.step_cycle(served.name, steps)
        reason = ensemble.describe_cycle(cycle) if cycle else _step_failure(registry, served)
        if reason is not None:
            await fail(served, reason, "ensemble")


def _step_failure(registry: ModelRegistry, served: ServedVersion) -> str | None:
    """Why the first step that cannot run on its served model cannot, or None (a step
    that is an ensemble is checked by what it declares, as a model is)."""
    for step in served.steps:
        try:
            model = registry.resolve(step.model, step.version)
        except errors.ServiceError:
            continue
        if model.decoupled:
            return (
                f"{step.describe()} is decoupled (it answers through ModelStreamInfer "
                "with many responses); an ensemble step must answer once"
            )
        reason = ensemble.check_step(step, served.config, model.config)
        if reason is not None:
            return reason
    return None


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
