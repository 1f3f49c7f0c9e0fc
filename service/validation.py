"""Check an inference request against the model's declared inputs before it reaches a worker.

Paddle silently reuses the previous caller's data for an input that is not set, accepts wrong
ranks and some wrong dtypes, and can crash on others (measured with Paddle 3.3), so nothing
that fails here may ever reach a predictor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.errors import invalid
from service.inference import InferJob, InputTensor
from service.model_parameters import check_parameters
from service.tensors import BY_CONFIG_TYPE, Datatype
from transport.bytes_tensor import deserialize_bytes, serialize_bytes

# Where config.pbtxt sets no max_input_elements: an input with variable non-batch dimensions
# may hold this many elements per batch row (a fixed-shape input is bounded by its shape).
DEFAULT_ELEMENTS_PER_ROW = 1 << 20


@dataclass(frozen=True)
class _Declared:
    datatype: Datatype
    dims: tuple[int, ...]  # without the batch dimension when the model batches
    max_elements: int | None  # per request; None: the fixed dims bound it


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
        self.inputs = {
            i.name: _Declared(
                BY_CONFIG_TYPE[i.data_type], tuple(i.dims), element_limit(config, tuple(i.dims))
            )
            for i in config.input
        }
        self.outputs = tuple(o.name for o in config.output)

    def validate(self, request: pb.ModelInferRequest) -> InferJob:
        """The request as a job, or INVALID_ARGUMENT saying what is wrong."""
        raw = request.raw_input_contents
        if raw and len(raw) != len(request.inputs):
            raise invalid(
                f"model '{self.model}': {len(raw)} raw_input_contents for "
                f"{len(request.inputs)} inputs; send one per input, in order"
            )
        seen: dict[str, InputTensor] = {}
        for index, tensor in enumerate(request.inputs):
            declared = self._declared(tensor.name, seen)
            shape = self._check_shape(tensor.name, tensor.datatype, tuple(tensor.shape), declared)
            if raw:
                if tensor.HasField("contents"):
                    raise invalid(
                        f"input '{tensor.name}': both raw_input_contents and contents are set; "
                        "use one"
                    )
                data = self._check_raw(tensor.name, raw[index], declared, shape)
            else:
                data = self._typed_data(tensor, declared, shape)
            seen[tensor.name] = InputTensor(tensor.name, declared.datatype, shape, data)
        inputs = self._complete(seen)
        outputs = self._outputs(tuple(o.name for o in request.outputs))
        batch_size = self._batch(seen)
        return InferJob(inputs, outputs, batch_size, *request_scheduling(request))

    def check(self, inputs: Iterable[InputTensor], outputs: tuple[str, ...]) -> InferJob:
        """A job the server put together itself (an ensemble's step), checked as strictly as
        a caller's request."""
        seen: dict[str, InputTensor] = {}
        for tensor in inputs:
            declared = self._declared(tensor.name, seen)
            shape = self._check_shape(tensor.name, tensor.datatype.name, tensor.shape, declared)
            self._check_raw(tensor.name, tensor.data, declared, shape)
            seen[tensor.name] = tensor
        return InferJob(self._complete(seen), self._outputs(outputs), self._batch(seen))

    def _declared(self, name: str, seen: dict[str, InputTensor]) -> _Declared:
        if name in seen:
            raise invalid(f"input '{name}' appears more than once")
        declared = self.inputs.get(name)
        if declared is None:
            raise invalid(
                f"model '{self.model}' has no input '{name}'; its inputs are {sorted(self.inputs)}"
            )
        return declared

    def _complete(self, seen: dict[str, InputTensor]) -> tuple[InputTensor, ...]:
        if len(seen) != len(self.inputs):
            missing = sorted(set(self.inputs) - set(seen))
            raise invalid(
                f"model '{self.model}': missing input(s) {missing}; every input must be sent "
                "with every request"
            )
        return tuple(seen.values())

    def _check_shape(
        self, name: str, datatype: str, shape: tuple[int, ...], declared: _Declared
    ) -> tuple[int, ...]:
        if datatype != declared.datatype.name:
            raise invalid(
                f"input '{name}': expected datatype {declared.datatype.name}, "
                f"got {datatype or 'none'}"
            )
        expected = ((-1,) if self.max_batch_size > 0 else ()) + declared.dims
        if len(shape) != len(expected):
            raise invalid(
                f"input '{name}': expected rank {len(expected)} (shape {list(expected)}), "
                f"got shape {list(shape)}"
            )
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

    @staticmethod
    def _check_raw(name: str, data: bytes, declared: _Declared, shape: tuple[int, ...]) -> bytes:
        if declared.datatype.name == "BYTES":
            try:
                count = len(deserialize_bytes(data))
            except ValueError as exc:
                raise invalid(f"input '{name}': malformed BYTES contents: {exc}") from None
            if count != math.prod(shape):
                raise invalid(
                    f"input '{name}': shape {list(shape)} needs {math.prod(shape)} BYTES "
                    f"elements, raw_input_contents holds {count}"
                )
            return data
        expected = math.prod(shape) * declared.datatype.numpy.itemsize
        if len(data) != expected:
            raise invalid(
                f"input '{name}': shape {list(shape)} of {declared.datatype.name} needs "
                f"{expected} bytes of raw_input_contents, got {len(data)}"
            )
        return data

    @staticmethod
    def _typed_data(
        tensor: pb.ModelInferRequest.InferInputTensor, declared: _Declared, shape: tuple[int, ...]
    ) -> bytes:
        field = declared.datatype.contents_field
        if field is None:
            raise invalid(
                f"input '{tensor.name}': {declared.datatype.name} has no typed contents field; "
                "send it in raw_input_contents"
            )
        values = getattr(tensor.contents, field)
        count = math.prod(shape)
        if len(values) != count:
            raise invalid(
                f"input '{tensor.name}': shape {list(shape)} needs {count} values in "
                f"contents.{field}, got {len(values)}"
            )
        if declared.datatype.name == "BYTES":
            return serialize_bytes(values)
        try:
            return np.asarray(values, dtype=declared.datatype.numpy).tobytes()
        except OverflowError as exc:
            raise invalid(
                f"input '{tensor.name}': a value does not fit {declared.datatype.name}"
            ) from exc

    def _outputs(self, names: tuple[str, ...]) -> tuple[str, ...]:
        if not names:
            return self.outputs
        if len(set(names)) != len(names):
            raise invalid(f"requested outputs {list(names)} name an output more than once")
        unknown = [n for n in names if n not in self.outputs]
        if unknown:
            raise invalid(
                f"model '{self.model}' has no output(s) {unknown}; "
                f"its outputs are {list(self.outputs)}"
            )
        return names

    def _batch(self, inputs: dict[str, InputTensor]) -> int:
        if self.max_batch_size == 0:
            return 0
        sizes = {t.shape[0] for t in inputs.values()}
        if len(sizes) != 1:
            raise invalid(f"inputs disagree on the batch size: {sorted(sizes)}")
        return sizes.pop()


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
