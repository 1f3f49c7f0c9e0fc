"""The tensors the sequence batcher adds to a request of a sequence before it is batched: the
control inputs (START, END, READY, CORRID as the config spells them) and the implicit state the
sequence's last request left; and the state outputs taken back out of its answer, so callers
never see them."""

from __future__ import annotations

import dataclasses

import numpy as np

from oip.bytes_tensor import serialize_bytes
from oip.datatypes import Datatype
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


def corrid_bytes(corrid: int | str, datatype: Datatype) -> bytes:
    """The correlation id as the CORRID control's tensor: a string id in a BYTES tensor, an
    integer one truncated to the tensor's width (Triton: 32-bit types keep the low bits)."""
    if datatype.name == "BYTES":
        return serialize_bytes([str(corrid).encode()])
    if isinstance(corrid, str):
        raise errors.invalid(
            "this model's CORRID control is an integer; send sequence_id as an integer"
        )
    bits = datatype.numpy.itemsize * 8
    low = np.array([corrid & ((1 << bits) - 1)], np.uint64)
    return low.astype(datatype.numpy).tobytes()
