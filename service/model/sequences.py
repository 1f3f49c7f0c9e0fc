"""What a model's `sequence_batching` says (Triton's sequence batcher): the strategy and its
bounds, the control inputs the server sets on every request of a sequence, and the implicit
state it carries from one request to the next. Checked when the config is read, so a bad one
fails at load with the reason, never per request."""

from __future__ import annotations

import math
from dataclasses import dataclass

from oip.datatypes import BY_CONFIG_TYPE, Datatype
from protos.inference import model_config_pb2 as mc
from service.model.files import ENSEMBLE
from service.model.parameters import FALLBACK_MODEL, string_parameters

Control = mc.ModelSequenceBatching.Control
# Triton's default when max_sequence_idle_microseconds is 0 or unset.
DEFAULT_IDLE_S = 1.0
# Live sequences of an `oldest` model whose config leaves max_candidate_sequences unset.
DEFAULT_CANDIDATES = 64
# The most one sequence's implicit state may hold (all its states together, one row): what
# the server keeps per live sequence, times the live-sequence bound, is its memory.
MAX_STATE_BYTES = 16 << 20
_CORRID_TYPES = (mc.TYPE_UINT64, mc.TYPE_INT64, mc.TYPE_UINT32, mc.TYPE_INT32, mc.TYPE_STRING)
_FLAG_FIELDS = ("int32_false_true", "fp32_false_true", "bool_false_true")
_FLAG_TYPES = {
    "int32_false_true": mc.TYPE_INT32,
    "fp32_false_true": mc.TYPE_FP32,
    "bool_false_true": mc.TYPE_BOOL,
}


class SequenceConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ControlSpec:
    """One control input: its tensor, and the values it takes (false, true) for a flag."""

    name: str
    kind: int  # Control.Kind
    datatype: Datatype
    false_true: tuple[float, float] = (0, 1)


@dataclass(frozen=True)
class StateSpec:
    input_name: str
    output_name: str
    datatype: Datatype
    dims: tuple[int, ...]  # fixed: the state one sequence holds is bounded by the config

    @property
    def nbytes(self) -> int:
        return math.prod(self.dims) * self.datatype.numpy.itemsize


@dataclass(frozen=True)
class SequenceSettings:
    oldest: bool  # strategy `oldest` (else `direct`)
    idle_s: float
    controls: tuple[ControlSpec, ...]
    states: tuple[StateSpec, ...]
    max_candidates: int  # oldest: live sequences at most (direct: its slots bound them)
    preferred_sizes: tuple[int, ...]
    max_queue_delay_s: float
    minimum_slot_utilization: float  # direct: a batch this full goes before the delay ends

    def hidden_inputs(self) -> tuple[str, ...]:
        """Inputs the server sets and callers never send."""
        return tuple(c.name for c in self.controls) + tuple(s.input_name for s in self.states)


def is_sequence(config: mc.ModelConfig) -> bool:
    return config.HasField("sequence_batching")


def sequence_settings(config: mc.ModelConfig) -> SequenceSettings | None:
    """The model's sequence batching, or None when it has none; SequenceConfigError says
    what is wrong with it."""
    if not is_sequence(config):
        return None
    if config.platform == ENSEMBLE:
        raise SequenceConfigError("an ensemble cannot have sequence_batching")
    if config.model_transaction_policy.decoupled:
        raise SequenceConfigError("a decoupled model cannot have sequence_batching")
    if string_parameters(config).get(FALLBACK_MODEL, "").strip():
        raise SequenceConfigError(
            f"a sequence model cannot have a {FALLBACK_MODEL} (it would not hold the sequence)"
        )
    if config.model_warmup:
        raise SequenceConfigError(
            "model_warmup is not run for sequence models (a sample is not a sequence); remove it"
        )
    if not config.input or not config.output:
        raise SequenceConfigError(
            "a sequence model must list its inputs and outputs (the server adds its control "
            "and state tensors to them)"
        )
    batching = config.sequence_batching
    if batching.iterative_sequence:
        raise SequenceConfigError("iterative_sequence is not supported")
    controls = tuple(_control(c) for c in batching.control_input)
    states = tuple(_state(s) for s in batching.state)
    names = [c.name for c in controls] + [s.input_name for s in states]
    declared = {i.name for i in config.input}
    for name in names:
        if names.count(name) > 1:
            raise SequenceConfigError(f"input {name!r} is named twice in sequence_batching")
        if name in declared:
            raise SequenceConfigError(
                f"input {name!r} is set by the sequence batcher; do not list it in `input`"
            )
    outputs = {o.name for o in config.output}
    for state in states:
        if state.output_name in outputs:
            raise SequenceConfigError(
                f"output {state.output_name!r} is the state the server keeps; do not list it in "
                "`output`"
            )
    if sum(s.nbytes for s in states) > MAX_STATE_BYTES:
        raise SequenceConfigError(
            f"the states hold {sum(s.nbytes for s in states)} bytes per sequence; at most "
            f"{MAX_STATE_BYTES}"
        )
    strategy = batching.WhichOneof("strategy_choice")
    oldest = batching.oldest
    direct = batching.direct
    if strategy == "oldest" and oldest.max_candidate_sequences < 0:
        raise SequenceConfigError("oldest.max_candidate_sequences must be >= 1")
    idle_us = batching.max_sequence_idle_microseconds
    return SequenceSettings(
        oldest=strategy == "oldest",
        idle_s=idle_us / 1e6 if idle_us else DEFAULT_IDLE_S,
        controls=controls,
        states=states,
        max_candidates=oldest.max_candidate_sequences or DEFAULT_CANDIDATES,
        preferred_sizes=tuple(sorted(s for s in oldest.preferred_batch_size if s > 0)),
        max_queue_delay_s=(
            oldest.max_queue_delay_microseconds
            if strategy == "oldest"
            else direct.max_queue_delay_microseconds
        )
        / 1e6,
        minimum_slot_utilization=min(max(direct.minimum_slot_utilization, 0.0), 1.0),
    )


def _control(entry: mc.ModelSequenceBatching.ControlInput) -> ControlSpec:
    if len(entry.control) != 1:
        raise SequenceConfigError(
            f"control_input {entry.name!r} must have exactly one control, not {len(entry.control)}"
        )
    control = entry.control[0]
    if control.kind == Control.CONTROL_SEQUENCE_CORRID:
        if control.data_type not in _CORRID_TYPES:
            raise SequenceConfigError(
                f"control_input {entry.name!r}: CONTROL_SEQUENCE_CORRID needs data_type "
                "TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING"
            )
        return ControlSpec(entry.name, control.kind, BY_CONFIG_TYPE[control.data_type])
    given = [f for f in _FLAG_FIELDS if len(getattr(control, f))]
    if len(given) != 1 or len(getattr(control, given[0])) != 2:
        raise SequenceConfigError(
            f"control_input {entry.name!r}: {Control.Kind.Name(control.kind)} needs exactly one "
            "of int32_false_true, fp32_false_true, bool_false_true, with two values (false, true)"
        )
    values = getattr(control, given[0])
    return ControlSpec(
        entry.name,
        control.kind,
        BY_CONFIG_TYPE[_FLAG_TYPES[given[0]]],
        (values[0], values[1]),
    )


def _state(entry: mc.ModelSequenceBatching.State) -> StateSpec:
    if not entry.input_name or not entry.output_name:
        raise SequenceConfigError("a state needs input_name and output_name")
    if entry.data_type not in BY_CONFIG_TYPE or entry.data_type == mc.TYPE_STRING:
        raise SequenceConfigError(f"state {entry.input_name!r}: a numeric data_type is needed")
    dims = tuple(int(d) for d in entry.dims)
    if not dims or any(d < 1 for d in dims):
        raise SequenceConfigError(
            f"state {entry.input_name!r} has dims {list(dims)}; the server keeps states of a "
            "fixed shape only (what one sequence holds is bounded by the config)"
        )
    for initial in entry.initial_state:
        if initial.WhichOneof("state_data") != "zero_data":
            raise SequenceConfigError(
                f"state {entry.input_name!r}: only zero_data initial states are supported "
                "(paddlequic reads no data files)"
            )
    return StateSpec(entry.input_name, entry.output_name, BY_CONFIG_TYPE[entry.data_type], dims)


def with_sequence_tensors(config: mc.ModelConfig, settings: SequenceSettings) -> mc.ModelConfig:
    """The config as the engine sees the model: the control and state inputs, and the state
    outputs after the listed outputs (a Paddle 3 program names its outputs by position),
    added to what callers see."""
    full = mc.ModelConfig()
    full.CopyFrom(config)
    for control in settings.controls:
        full.input.add(name=control.name, data_type=control.datatype.config_type, dims=[1])
    for state in settings.states:
        full.input.add(name=state.input_name, data_type=state.datatype.config_type, dims=state.dims)
    if config.output:
        for state in settings.states:
            full.output.add(
                name=state.output_name, data_type=state.datatype.config_type, dims=state.dims
            )
    return full


def without_sequence_tensors(config: mc.ModelConfig, settings: SequenceSettings) -> mc.ModelConfig:
    """What callers see of the model: no control or state tensors."""
    hidden_in = set(settings.hidden_inputs())
    hidden_out = {s.output_name for s in settings.states}
    seen = mc.ModelConfig()
    seen.CopyFrom(config)
    del seen.input[:]
    del seen.output[:]
    seen.input.extend(i for i in config.input if i.name not in hidden_in)
    seen.output.extend(o for o in config.output if o.name not in hidden_out)
    return seen
