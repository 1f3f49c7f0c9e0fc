"""Triton-style ensembles: a graph of steps, each a served model whose inputs and outputs are
mapped to named tensors of the ensemble. A step runs once all its input tensors exist, so
independent steps run concurrently; every step goes through its model's own batcher and
instances, and intermediate tensors never leave the server. A step may name another ensemble
(Triton allows it), as long as no ensemble reaches itself through its steps."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from oip.datatypes import config_type_name
from protos.inference import model_config_pb2 as mc

# How deep ensembles nest (an ensemble whose step is an ensemble: 2), for the request path and
# readiness, which follow nested steps. A step cycle is refused at load, but until the check
# after a load has run (or if one slipped past it), following the steps must still end; a
# pipeline nested deeper than this is beyond any we know of.
MAX_ENSEMBLE_DEPTH = 8


class EnsembleError(ValueError):
    """The ensemble's graph cannot run; the message says why."""


@dataclass(frozen=True)
class Step:
    number: int  # 1-based, as people count the steps of config.pbtxt
    model: str
    version: str  # "" for the newest ready version
    inputs: Mapping[str, str]  # the step model's input -> ensemble tensor
    outputs: Mapping[str, str]  # the step model's output -> ensemble tensor

    def describe(self) -> str:
        return f"step {self.number} (model '{self.model}')"


def plan(config: mc.ModelConfig) -> tuple[Step, ...]:
    """The steps, checked so that every tensor a step reads is an ensemble input or written by
    exactly one step, every ensemble output is written, and no step waits on itself."""
    scheduling = config.ensemble_scheduling
    if not scheduling.step:
        raise EnsembleError("ensemble_scheduling lists no step")
    if not config.input or not config.output:
        raise EnsembleError("an ensemble must list its inputs and outputs in config.pbtxt")
    steps = tuple(
        Step(
            number,
            s.model_name,
            "" if s.model_version < 0 else str(s.model_version),
            dict(s.input_map),
            dict(s.output_map),
        )
        for number, s in enumerate(scheduling.step, 1)
    )
    itself = step_cycle(config.name, {config.name: {s.model for s in steps}})
    if itself is not None:  # the cycles through other ensembles are found once they load
        raise EnsembleError(describe_cycle(itself))
    available = {t.name for t in config.input}
    writers: dict[str, Step] = {}
    for step in steps:
        if not step.model:
            raise EnsembleError(f"step {step.number} names no model_name")
        for tensor in step.outputs.values():
            if tensor in available or tensor in writers:
                raise EnsembleError(f"tensor '{tensor}' is written twice ({step.describe()})")
            writers[tensor] = step
    for step in steps:
        for tensor in step.inputs.values():
            if tensor not in available and tensor not in writers:
                raise EnsembleError(
                    f"{step.describe()} reads tensor '{tensor}', which neither an ensemble "
                    "input nor any step's output provides"
                )
    for output in config.output:
        if output.name not in writers:
            raise EnsembleError(f"no step writes the ensemble output '{output.name}'")
    order(steps, available)
    return steps


def order(steps: tuple[Step, ...], available: set[str]) -> list[list[Step]]:
    """Waves of steps that can run together; EnsembleError when some step can never run."""
    have, left, waves = set(available), list(steps), []
    while left:
        wave = [s for s in left if set(s.inputs.values()) <= have]
        if not wave:
            raise EnsembleError(
                "steps wait on each other in a cycle: " + ", ".join(s.describe() for s in left)
            )
        waves.append(wave)
        for step in wave:
            have.update(step.outputs.values())
        left = [s for s in left if s not in wave]
    return waves


def check_step(step: Step, ensemble: mc.ModelConfig, model: mc.ModelConfig) -> str | None:
    """Why `model` cannot run `step` of `ensemble` (names, or datatypes where the ensemble
    declares the tensor), or None."""
    declared = {t.name: t.data_type for t in list(ensemble.input) + list(ensemble.output)}
    for kind, mapping, entries in (
        ("input", step.inputs, model.input),
        ("output", step.outputs, model.output),
    ):
        types = {e.name: e.data_type for e in entries}
        for name, tensor in mapping.items():
            if name not in types:
                known = sorted(types)
                return f"{step.describe()}: the model has no {kind} '{name}'; it has {known}"
            if tensor in declared and declared[tensor] != types[name]:
                return (
                    f"{step.describe()}: {kind} '{name}' is "
                    f"{config_type_name(types[name])}, the ensemble's tensor '{tensor}' "
                    f"{config_type_name(declared[tensor])}"
                )
    missing = sorted({e.name for e in model.input} - set(step.inputs))
    if missing:
        return f"{step.describe()}: input_map leaves the model's input(s) {missing} unset"
    return None


def step_cycle(name: str, steps: Mapping[str, Collection[str]]) -> tuple[str, ...] | None:
    """The shortest path by which ensemble `name` reaches itself through its steps (`name`
    first and last), or None. `steps` maps each ensemble to the models its steps name;
    anything else is a model that runs, and ends a path. Such a cycle would never answer."""
    came_from: dict[str, str] = {}
    frontier = [name]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(steps.get(node, ())):
                if target == name:
                    back = [node]
                    while back[-1] != name:
                        back.append(came_from[back[-1]])
                    return (*reversed(back), name)
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    return None


def describe_cycle(path: tuple[str, ...]) -> str:
    return "ensemble step cycle: " + " -> ".join(path)
