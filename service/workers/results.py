"""A worker's answers as callers see them: outputs under the names and datatypes the model's
config declares, copied out of the slot request by request, and failures as gRPC errors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import grpc

from oip.datatypes import Datatype
from service.batching.assemble import Batch
from service.inference import errors
from service.inference.jobs import InferResult, OutputTensor
from service.workers import protocol
from service.workers.slots import Slot

BAD_INPUT_ERRORS = ("InvalidArgumentError", "OutOfRangeError")
# pb_utils.TritonError's codes (TRITONSERVER_Error_Code) as the gRPC status Triton reports them
# under (src/grpc/grpc_utils.cc); an unknown code is INTERNAL.
TRITON_STATUS = {
    0: grpc.StatusCode.UNKNOWN,
    1: grpc.StatusCode.INTERNAL,
    2: grpc.StatusCode.NOT_FOUND,
    3: grpc.StatusCode.INVALID_ARGUMENT,
    4: grpc.StatusCode.UNAVAILABLE,
    5: grpc.StatusCode.UNIMPLEMENTED,
    6: grpc.StatusCode.ALREADY_EXISTS,
    7: grpc.StatusCode.CANCELLED,
}
_TRITON_CODE = {status: code for code, status in TRITON_STATUS.items()}
# Statuses Triton has no code of their own for: it reports a timed-out or refused request as
# UNAVAILABLE.
_UNAVAILABLE = (
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)


def triton_code(status: grpc.StatusCode) -> int:
    """The TRITONSERVER_Error_Code a gRPC status is given to a Python model as (a BLS
    response's error); UNKNOWN for one Triton has no counterpart of."""
    if status in _UNAVAILABLE:
        return _TRITON_CODE[grpc.StatusCode.UNAVAILABLE]
    return _TRITON_CODE.get(status, _TRITON_CODE[grpc.StatusCode.UNKNOWN])


class Outputs:
    """One model's outputs, as its config declares them."""

    def __init__(self) -> None:
        # Outputs config.pbtxt renames: callers use the configured names, the worker's
        # program its fetch names (fetch_name_N).
        self._fetch_names: dict[str, str] = {}
        self._served_names: dict[str, str] = {}
        self._datatypes: dict[str, Datatype] = {}

    def declare(self, datatypes: Mapping[str, Datatype], fetch_names: Mapping[str, str]) -> None:
        """The outputs as the model's config declares them (response datatypes come from here,
        not from numpy, which has no BF16), and configured output name -> the program's fetch
        name, for renamed outputs."""
        self._datatypes = dict(datatypes)
        self._fetch_names = dict(fetch_names)
        self._served_names = {fetch: served for served, fetch in fetch_names.items()}

    def fetch_names(self, outputs: Iterable[str]) -> tuple[str, ...]:
        """What the worker's program calls the outputs a batch asks for."""
        return tuple(self._fetch_names.get(n, n) for n in outputs)

    def split(
        self, slot: Slot, batch: Batch, message: protocol.Result, queue_ns: int
    ) -> InferResult | errors.ServiceError:
        """Each request's outputs, copied out of the slot before it is handed on."""
        views = slot.read(message, self._served_names, self._datatypes)
        try:
            return InferResult(batch.split(views), message.timings, queue_ns)
        except errors.ServiceError as exc:
            return exc
        finally:
            for view in views:
                if isinstance(view.data, memoryview):
                    view.data.release()

    def response(self, message: protocol.Response) -> tuple[OutputTensor, ...]:
        """A decoupled response's outputs (any of the configured ones, each as declared);
        INTERNAL naming what does not fit the config."""
        outputs = []
        for ref in message.outputs:
            name = self._served_names.get(ref.name, ref.name)
            datatype = self._datatypes.get(name)
            if datatype is None:
                raise errors.internal(
                    f"the model sent output {errors.echoed(ref.name)!r}, which its config does "
                    f"not declare; it declares {sorted(self._datatypes)}"
                )
            data = message.data[ref.offset : ref.offset + ref.nbytes]
            if len(data) != ref.nbytes:
                raise errors.internal(f"the model's output {name!r} lies outside its response")
            outputs.append(OutputTensor(name, datatype, ref.shape, data))
        return tuple(outputs)


def failure(message: protocol.Failed, model_name: str) -> errors.ServiceError:
    text = f"model '{model_name}' failed: {message.message}"
    if message.too_large:
        return errors.ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, text)
    # Paddle's InvalidArgument/OutOfRange errors are about the request's values
    # (e.g. embedding ids out of range), which validation cannot see.
    bad_input = any(k in message.message for k in BAD_INPUT_ERRORS)
    return (errors.invalid if bad_input else errors.internal)(text)
