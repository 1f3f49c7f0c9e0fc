"""Check an inference request against the model's declared inputs before it reaches a worker.

Paddle silently reuses the previous caller's data for an input that is not set, accepts wrong
ranks and some wrong dtypes, and can crash on others (measured with Paddle 3.3), so nothing
that fails here may ever reach a predictor.

The work is bounded by what the request declares, never by what the peer sent: every loop runs
over the model's inputs and outputs (one more entry refuses), a shape's rank is compared before
the shape is read, and contents are compared with the element count the shape implies (BYTES
elements are walked at most that far). Checks that cost no per-element work come first
(`admit`); what is left (`Decoding`) is per-element work bounded by the declared shapes, done
on the event loop when it is small and in a thread otherwise (`decoded`).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from oip.bytes_tensor import scan_bytes, serialize_bytes
from oip.datatypes import BY_CONFIG_TYPE, Datatype
from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.inference.errors import echoed, invalid
from service.inference.jobs import InferJob, InputTensor, SequenceFlags
from service.model.parameters import check_parameters

# Where config.pbtxt sets no max_input_elements: an input with variable non-batch dimensions
# may hold this many elements per batch row (a fixed-shape input is bounded by its shape).
DEFAULT_ELEMENTS_PER_ROW = 1 << 20
# Per-element work (BYTES elements walked, typed values converted) a request may do on the
# event loop: a few milliseconds. A request declaring more is decoded in a thread, whose
# Python-level loops let the event loop run in between, so other calls keep being answered.
INLINE_DECODE_ELEMENTS = 1 << 14
# Typed values converted per step: each step is one short call that holds the GIL.
CONVERT_CHUNK = 1 << 14
# Error messages repeat a wrong shape up to this rank, and only its rank beyond.
SHOWN_RANK = 8


@dataclass(frozen=True)
class _Declared:
    datatype: Datatype
    dims: tuple[int, ...]  # without the batch dimension when the model batches
    max_elements: int | None  # per request; None: the fixed dims bound it
    max_bytes: int | None  # its contents, serialized, per request: config's max_input_bytes


@dataclass(frozen=True)
class _Contents:
    """One input whose shape passed, and the per-element work its contents still need."""

    name: str
    datatype: Datatype
    shape: tuple[int, ...]
    work: int  # elements `decode` walks or converts (0: nothing left to do)
    decode: Callable[[], bytes]  # the tensor's data, or INVALID_ARGUMENT


@dataclass(frozen=True)
class Decoding:
    """A request that passed every check costing no per-element work (names, datatypes, ranks,
    shapes and limits, byte and value counts). Decoding it walks or converts `work` elements,
    at most the elements its shapes declare, however many bytes came with it."""

    inputs: tuple[_Contents, ...]
    outputs: tuple[str, ...]
    batch_size: int
    priority: int | None = None
    timeout_s: float | None = None
    sequence: SequenceFlags | None = None

    @property
    def work(self) -> int:
        return sum(c.work for c in self.inputs)

    @property
    def inline(self) -> bool:
        """Cheap enough to finish on the event loop (else in a thread)."""
        return self.work <= INLINE_DECODE_ELEMENTS

    def finish(self) -> InferJob:
        """The job; INVALID_ARGUMENT when some contents do not hold what the shape says."""
        inputs = tuple(InputTensor(c.name, c.datatype, c.shape, c.decode()) for c in self.inputs)
        return InferJob(
            inputs,
            self.outputs,
            self.batch_size,
            self.priority,
            self.timeout_s,
            sequence=self.sequence,
        )


async def decoded(decoding: Decoding) -> InferJob:
    """The job: decoded on the event loop when that is cheap, else in a thread."""
    if decoding.inline:
        return decoding.finish()
    return await asyncio.to_thread(decoding.finish)


def element_limit(config: mc.ModelConfig, dims: tuple[int, ...]) -> int | None:
    """The most elements one request may send for an input: config.pbtxt's
    max_input_elements, else DEFAULT_ELEMENTS_PER_ROW per batch row for an input with variable
    dimensions, so one long sequence cannot exhaust a worker's memory."""
    configured = check_parameters(config).max_input_elements  # checked when the model was read
    if configured is not None:
        return configured
    if -1 in dims:
        return max(config.max_batch_size, 1) * DEFAULT_ELEMENTS_PER_ROW
    return None


class RequestValidator:
    def __init__(self, config: mc.ModelConfig) -> None:
        self.model = config.name
        self.max_batch_size = config.max_batch_size
        max_bytes = check_parameters(config).max_input_bytes
        self.inputs = {
            i.name: _Declared(
                BY_CONFIG_TYPE[i.data_type],
                tuple(i.dims),
                element_limit(config, tuple(i.dims)),
                max_bytes,
            )
            for i in config.input
        }
        self.outputs = tuple(o.name for o in config.output)
        # Triton's `optional: true`, honoured where each request runs alone (a decoupled
        # model's): a batch needs every input of every request in it.
        self.optional = (
            frozenset(i.name for i in config.input if i.optional)
            if config.model_transaction_policy.decoupled
            else frozenset()
        )

    def validate(self, request: pb.ModelInferRequest) -> InferJob:
        """The request as a job, or INVALID_ARGUMENT saying what is wrong."""
        return self.admit(request).finish()

    def admit(
        self, request: pb.ModelInferRequest, raw_contents: Sequence[bytes] | None = None
    ) -> Decoding:
        """The request's checks that cost no per-element work; INVALID_ARGUMENT on the first
        that fails. `raw_contents`: the inputs' bytes when they did not come in the message
        (read from shared memory), in the order of its inputs."""
        raw = request.raw_input_contents if raw_contents is None else raw_contents
        if raw:
            _check_no_contents(request, self.model)
        if raw and len(raw) != len(request.inputs):
            raise invalid(
                f"model '{self.model}': {len(raw)} raw_input_contents for "
                f"{len(request.inputs)} inputs; send one per input, in order"
            )
        seen: dict[str, _Contents] = {}
        for index, tensor in enumerate(request.inputs):  # each entry is new, or it refuses
            declared = self._declared(tensor.name, seen)
            shape = self._check_shape(tensor.name, tensor.datatype, tensor.shape, declared)
            if raw:
                seen[tensor.name] = _raw(tensor.name, raw[index], declared, shape, self.model)
            else:
                seen[tensor.name] = _typed(tensor, declared, shape, self.model)
        inputs = self._complete(seen)
        outputs = self._outputs(o.name for o in request.outputs)
        batch_size = self._batch(inputs)
        return Decoding(
            inputs, outputs, batch_size, *request_scheduling(request), request_sequence(request)
        )

    def check(
        self,
        inputs: Iterable[InputTensor],
        outputs: tuple[str, ...],
        priority: int | None = None,
        timeout_s: float | None = None,
        sequence: SequenceFlags | None = None,
    ) -> Decoding:
        """A job the server put together itself (an ensemble's step), had a front-end
        describe, or decoded from a wire format of its own (REST's JSON), checked as strictly
        as a caller's request."""
        seen: dict[str, _Contents] = {}
        for tensor in inputs:
            declared = self._declared(tensor.name, seen)
            shape = self._check_shape(tensor.name, tensor.datatype.name, tensor.shape, declared)
            seen[tensor.name] = _raw(tensor.name, tensor.data, declared, shape, self.model)
        checked = self._complete(seen)
        return Decoding(
            checked, self._outputs(outputs), self._batch(checked), priority, timeout_s, sequence
        )

    def declared_shape(self, name: str, datatype: str, sent: Sequence[int]) -> tuple[int, ...]:
        """An input's shape as a request states it, checked against the model before its
        contents are looked at (for a wire format that must convert them: JSON): the name is
        one of its inputs, the datatype and rank are the declared ones (the rank compared
        before the shape is read), then fixed dims, max_batch_size and max_input_elements."""
        return self._check_shape(name, datatype, sent, self._declared(name, {}))

    def _declared(self, name: str, seen: dict[str, _Contents]) -> _Declared:
        if name in seen:
            raise invalid(f"input '{name}' appears more than once")
        declared = self.inputs.get(name)
        if declared is None:
            raise invalid(
                f"model '{self.model}' has no input '{echoed(name)}'; its inputs are "
                f"{sorted(self.inputs)}"
            )
        return declared

    def _complete(self, seen: dict[str, _Contents]) -> tuple[_Contents, ...]:
        if len(seen) != len(self.inputs):
            missing = sorted(set(self.inputs) - set(seen) - self.optional)
            if missing:
                raise invalid(
                    f"model '{self.model}': missing input(s) {missing}; every input that is "
                    "not optional must be sent with every request"
                )
        return tuple(seen.values())

    def _check_shape(
        self, name: str, datatype: str, sent: Sequence[int], declared: _Declared
    ) -> tuple[int, ...]:
        if datatype != declared.datatype.name:
            raise invalid(
                f"input '{name}': expected datatype {declared.datatype.name}, "
                f"got {echoed(datatype) or 'none'}"
            )
        expected = ((-1,) if self.max_batch_size > 0 else ()) + declared.dims
        if len(sent) != len(expected):  # before the shape is read: its rank is the peer's
            shown = f"shape {list(sent)}" if len(sent) <= SHOWN_RANK else f"rank {len(sent)}"
            raise invalid(
                f"input '{name}': expected rank {len(expected)} (shape {list(expected)}), "
                f"got {shown}"
            )
        shape = tuple(sent)
        if any(d <= 0 for d in shape):
            raise invalid(f"input '{name}': every dimension must be >= 1, got {list(shape)}")
        for axis, (got, want) in enumerate(zip(shape, expected, strict=True)):
            if want != -1 and got != want:
                raise invalid(
                    f"input '{name}': dimension {axis} must be {want} "
                    f"(shape {list(expected)}), got {list(shape)}"
                )
        if self.max_batch_size > 0 and shape[0] > self.max_batch_size:
            raise invalid(
                f"input '{name}': batch size {shape[0]} exceeds max_batch_size "
                f"{self.max_batch_size} of model '{self.model}'"
            )
        limit = declared.max_elements
        if limit is not None and math.prod(shape) > limit:
            raise invalid(
                f"input '{name}': shape {list(shape)} has {math.prod(shape)} elements, more than "
                f"max_input_elements {limit} of model '{self.model}'"
            )
        return shape

    def _outputs(self, names: Iterable[str]) -> tuple[str, ...]:
        chosen: list[str] = []
        for name in names:  # each entry is new and known, or it refuses
            if name not in self.outputs:
                raise invalid(
                    f"model '{self.model}' has no output '{echoed(name)}'; "
                    f"its outputs are {list(self.outputs)}"
                )
            if name in chosen:
                raise invalid(f"output '{name}' is requested more than once")
            chosen.append(name)
        return tuple(chosen) or self.outputs

    def _batch(self, inputs: tuple[_Contents, ...]) -> int:
        if self.max_batch_size == 0:
            return 0
        sizes = {c.shape[0] for c in inputs}
        if len(sizes) != 1:
            raise invalid(f"inputs disagree on the batch size: {sorted(sizes)}")
        return sizes.pop()


def _within_bytes(name: str, size: int, declared: _Declared, model: str) -> None:
    """The model declared the largest input it takes (max_input_bytes): it is never handed
    more."""
    if declared.max_bytes is not None and size > declared.max_bytes:
        raise invalid(
            f"input '{name}' has {size} bytes, more than max_input_bytes {declared.max_bytes} "
            f"of model '{model}'"
        )


def _raw(
    name: str, data: bytes, declared: _Declared, shape: tuple[int, ...], model: str
) -> _Contents:
    """Raw contents: their size is checked against max_input_bytes, a fixed-size datatype's
    byte count too, and its bytes are used as they came (no copy); a BYTES tensor's elements
    are walked when decoding."""
    _within_bytes(name, len(data), declared, model)
    count = math.prod(shape)
    datatype = declared.datatype
    if datatype.name == "BYTES":
        return _Contents(
            name, datatype, shape, count, functools.partial(_walked, name, data, shape)
        )
    expected = count * datatype.numpy.itemsize
    if len(data) != expected:
        raise invalid(
            f"input '{name}': shape {list(shape)} of {datatype.name} needs "
            f"{expected} bytes of raw_input_contents, got {len(data)}"
        )
    return _Contents(name, datatype, shape, 0, lambda: data)


def _walked(name: str, data: bytes, shape: tuple[int, ...]) -> bytes:
    """BYTES raw contents, walked no further than the elements `shape` declares."""
    count = math.prod(shape)
    scan = scan_bytes(data, count)
    if scan.problem:
        raise invalid(f"input '{name}': malformed BYTES contents: {scan.problem}")
    if not scan.matches(count):
        raise invalid(
            f"input '{name}': shape {list(shape)} needs {count} BYTES elements, "
            f"raw_input_contents holds {scan.held()}"
        )
    return data


def _typed(
    tensor: pb.ModelInferRequest.InferInputTensor,
    declared: _Declared,
    shape: tuple[int, ...],
    model: str,
) -> _Contents:
    """Typed contents: the value count is checked now (a list's length costs nothing), the
    values are converted when decoding; their size (serialized, as raw contents would be) is
    checked against max_input_bytes now when the datatype fixes it, else once serialized."""
    datatype = declared.datatype
    field = datatype.contents_field
    if field is None:
        raise invalid(
            f"input '{tensor.name}': {datatype.name} has no typed contents field; "
            "send it in raw_input_contents"
        )
    values = getattr(tensor.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise invalid(
            f"input '{tensor.name}': shape {list(shape)} needs {count} values in "
            f"contents.{field}, got {len(values)}"
        )
    if datatype.name == "BYTES":
        decode = functools.partial(_serialized, tensor.name, values, declared, model)
    else:
        _within_bytes(tensor.name, count * datatype.numpy.itemsize, declared, model)
        decode = functools.partial(_converted, tensor.name, values, datatype)
    return _Contents(tensor.name, datatype, shape, count, decode)


def _serialized(name: str, values: Sequence[bytes], declared: _Declared, model: str) -> bytes:
    data = serialize_bytes(values)
    _within_bytes(name, len(data), declared, model)
    return data


def _converted(name: str, values: Sequence[float], datatype: Datatype) -> bytes:
    """Typed values as little-endian bytes, converted a chunk at a time."""
    out = np.empty(len(values), datatype.numpy)
    try:
        for start in range(0, len(values), CONVERT_CHUNK):
            out[start : start + CONVERT_CHUNK] = values[start : start + CONVERT_CHUNK]
    except OverflowError as exc:
        raise invalid(f"input '{name}': a value does not fit {datatype.name}") from exc
    return out.tobytes()


def _check_no_contents(request: pb.ModelInferRequest, model: str) -> None:
    """A request with raw_input_contents has no typed contents, in Triton's words (which its
    clients compare), checked before the raw contents are counted, as Triton does."""
    for tensor in request.inputs:
        if tensor.HasField("contents"):
            raise invalid(
                "contents field must not be specified when using raw_input_contents for "
                f"'{echoed(tensor.name)}' for model '{model}'; send every input in "
                "raw_input_contents or every one in contents"
            )


def request_scheduling(request: pb.ModelInferRequest) -> tuple[int | None, float | None]:
    """Triton's request parameters: `priority` (1 = highest) and `timeout` (microseconds)."""
    values: list[int | None] = []
    for key in ("priority", "timeout"):
        parameter = request.parameters.get(key)
        kind = parameter.WhichOneof("parameter_choice") if parameter is not None else None
        if kind not in ("int64_param", "uint64_param"):
            if kind is not None:
                raise invalid(f"request parameter '{key}' must be an integer")
            values.append(None)
            continue
        value = int(getattr(parameter, kind))
        if value < 0:
            raise invalid(f"request parameter '{key}' must not be negative")
        values.append(value)
    priority, timeout_us = values
    return priority, None if timeout_us is None else timeout_us / 1e6


# The longest string sequence_id taken: it is kept per live sequence and echoed in errors.
MAX_SEQUENCE_ID_CHARS = 256


SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


def request_sequence(request: pb.ModelInferRequest) -> SequenceFlags | None:
    """Triton's sequence parameters as tritonclient sends them over gRPC (`sequence_flags`)."""
    parameters = request.parameters
    return sequence_flags(
        {key: _plain(parameters[key]) for key in SEQUENCE_PARAMETERS if key in parameters}
    )


def _plain(parameter: pb.InferParameter) -> object:
    """A parameter's value as Python holds it (None: it has none)."""
    kind = parameter.WhichOneof("parameter_choice")
    return None if kind is None else getattr(parameter, kind)


def sequence_flags(parameters: Mapping[str, object]) -> SequenceFlags | None:
    """Triton's sequence parameters, as plain values whatever the protocol (an integer, a
    string, a boolean; None: a parameter without a value): `sequence_id` (a non-zero integer or
    a non-empty string; 0 or "" is no sequence), `sequence_start`, `sequence_end`."""
    if "sequence_id" not in parameters:
        if "sequence_start" in parameters or "sequence_end" in parameters:
            raise invalid("sequence_start / sequence_end need a sequence_id")
        return None
    corrid = parameters["sequence_id"]
    if isinstance(corrid, int) and not isinstance(corrid, bool):
        if corrid < 0:
            raise invalid("request parameter 'sequence_id' must not be negative")
    elif isinstance(corrid, str):
        if len(corrid) > MAX_SEQUENCE_ID_CHARS:
            raise invalid(
                f"request parameter 'sequence_id' has {len(corrid)} characters; at most "
                f"{MAX_SEQUENCE_ID_CHARS}"
            )
    else:
        raise invalid("request parameter 'sequence_id' must be an integer or a string")
    flags = []
    for key in ("sequence_start", "sequence_end"):
        value = parameters.get(key, False)
        if not isinstance(value, bool):
            raise invalid(f"request parameter '{key}' must be a boolean")
        flags.append(value)
    if not corrid:
        return None
    start, end = flags
    return SequenceFlags(corrid, start, end)
