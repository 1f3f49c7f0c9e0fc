"""The tensors the sequence batcher adds to a request of a sequence before it is batched: the
control inputs (START, END, READY, CORRID as the config spells them) and the implicit state the
sequence's last request left; and the state outputs taken back out of its answer, so callers
never see them."""

from __future__ import annotations

import dataclasses

import numpy as np

from oip.bytes_tensor import serialize_bytes
from oip.datatypes import Datatype, config_type_name
from service.inference import errors
from service.inference.jobs import InferJob, InputTensor, OutputTensor
from service.model.sequences import Control, ControlSpec, SequenceSettings

# One sequence's implicit state: state output name -> one row of it, as the model left it.
State = dict[str, bytes]


def with_sequence_inputs(
    job: InferJob,
    settings: SequenceSettings,
    corrid: int | str,
    held: State | None,
    start: bool,
    end: bool,
) -> InferJob:
    """The job with its control and state inputs after its own, and the state outputs asked
    for; `held` None: the sequence starts from its initial (zero) state. A job of a sequence
    has one row; a warm-up job of several gets the same controls and zero states in each."""
    rows = job.rows
    batched = job.batch_size > 0
    controls = tuple(_control(c, start, end, corrid, rows, batched) for c in settings.controls)
    states = tuple(
        InputTensor(
            s.input_name,
            s.datatype,
            (rows, *s.dims) if batched else s.dims,
            held[s.output_name] if held is not None else bytes(s.nbytes * rows),
        )
        for s in settings.states
    )
    outputs = job.outputs + tuple(s.output_name for s in settings.states)
    return dataclasses.replace(job, inputs=job.inputs + controls + states, outputs=outputs)


def taken_state(
    outputs: tuple[OutputTensor, ...], settings: SequenceSettings
) -> tuple[tuple[OutputTensor, ...], State]:
    """The outputs callers see, and the state the model left for the sequence's next request;
    INTERNAL when the model's state output does not have the configured size."""
    by_name = {o.name: o for o in outputs}
    state: State = {}
    for spec in settings.states:
        tensor = by_name.get(spec.output_name)
        if tensor is None or len(tensor.data) != spec.nbytes:
            size = "none" if tensor is None else f"{len(tensor.data)} bytes"
            raise errors.internal(
                f"the model's state output '{spec.output_name}' holds {size}, not the "
                f"{spec.nbytes} bytes its state {list(spec.dims)} "
                f"{spec.datatype.name} declares; the sequence ended"
            )
        state[spec.output_name] = tensor.data
    return tuple(o for o in outputs if o.name not in state), state


def _control(
    control: ControlSpec, start: bool, end: bool, corrid: int | str, rows: int, batched: bool
) -> InputTensor:
    shape = (rows, 1) if batched else (1,)
    if control.kind == Control.CONTROL_SEQUENCE_CORRID:
        data = corrid_bytes(corrid, control.datatype) * rows
        return InputTensor(control.name, control.datatype, shape, data)
    flags: dict[int, bool] = {
        Control.CONTROL_SEQUENCE_START: start,
        Control.CONTROL_SEQUENCE_END: end,
        Control.CONTROL_SEQUENCE_READY: True,  # a row runs only when its sequence has a request
    }
    value = control.false_true[int(flags[control.kind])]
    data = np.full(rows, value, control.datatype.numpy).tobytes()
    return InputTensor(control.name, control.datatype, shape, data)


def check_corrid(corrid: int | str, settings: SequenceSettings, model: str) -> None:
    """INVALID_ARGUMENT when the model's CORRID control cannot hold the id exactly: two ids
    would present the same CORRID (7 and 2**32 + 7 in a UINT32, 42 and "42" in a STRING), and
    a model keeping state by CORRID would mix their sequences. Triton writes an integer id's
    bytes into a STRING CORRID as they come (not a string): an integer id is refused there."""
    for control in settings.controls:
        if control.kind != Control.CONTROL_SEQUENCE_CORRID:
            continue
        kind = config_type_name(control.datatype.config_type)
        if control.datatype.name == "BYTES":
            if not isinstance(corrid, str):
                raise errors.invalid(
                    f"the CORRID control of {model} is a string ({kind}); send sequence_id "
                    "as a string, not an integer"
                )
            continue
        if isinstance(corrid, str):
            raise errors.invalid(
                f"the CORRID control of {model} is an integer ({kind}); send sequence_id as "
                "an integer, not a string"
            )
        info = np.iinfo(control.datatype.numpy)
        if not int(info.min) <= corrid <= int(info.max):
            raise errors.invalid(
                f"sequence_id {corrid} does not fit the CORRID control of {model} ({kind}: "
                f"at most {int(info.max)}); send a smaller one"
            )


def corrid_bytes(corrid: int | str, datatype: Datatype) -> bytes:
    """The correlation id as the CORRID control's tensor: a BYTES element (warm-up's 0 as
    "0"), or an integer in the tensor's type (check_corrid: a request's id fits)."""
    if datatype.name == "BYTES":
        return serialize_bytes([str(corrid).encode()])
    return np.array([corrid], datatype.numpy).tobytes()
