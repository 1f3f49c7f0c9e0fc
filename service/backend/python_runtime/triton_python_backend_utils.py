"""The part of Triton's Python backend API (`import triton_python_backend_utils as pb_utils`)
that pre/post-processing, decoupled (streaming) and BLS models use, so their model.py runs here
unchanged. Python-model workers make this module importable under that name before they import
model.py. Only the model-facing API lives here: where a decoupled response goes is the
ResponseChannel a worker hands each request, and where a BLS call goes the ModelCaller the
worker installs (set_model_caller)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import re
import struct
import sys
import threading
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, NoReturn, Protocol

import numpy as np

from service.backend import model_log

TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


_NUMBER_OF_TYPE = {name: number for number, name in enumerate(TRITON_STRING_TO_NUMPY, 1)}
_NUMPY_OF_NUMBER = {_NUMBER_OF_TYPE[n]: t for n, t in TRITON_STRING_TO_NUMPY.items()}

# Triton's flag values (tritonserver.h)
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_CPU = 0
TRITONSERVER_MEMORY_GPU = 2


class PreferredMemory:
    """Where a BLS call's outputs should be: accepted, and always CPU here."""

    def __init__(self, preferred_memory_type: int, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


class TritonError:
    # Triton's TRITONSERVER_Error_Code values
    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    pass


SENDER_CLOSED = "Unable to send response. Response sender has been closed."


class Tensor:
    def __init__(self, name: str, array: Any) -> None:
        self._name = name
        self._array = np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray[Any, Any]:
        return self._array

    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def triton_dtype(self) -> int | None:
        return numpy_to_triton_type(self._array.dtype.type)

    def to_dlpack(self) -> Any:
        return self._array.__dlpack__()

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._array.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A tensor of any DLPack producer on the CPU (numpy reads it without a copy)."""
        return Tensor(name, np.from_dlpack(capsule))


class ResponseChannel(Protocol):
    """Where one decoupled request's responses go (the worker's side of a sender)."""

    def send(self, response: InferenceResponse | None, final: bool) -> None:
        """A data response blocks while the request's window is full (a final one never);
        drops the response once the request is cancelled; raises TritonModelException for a
        response the config does not allow, or after the final one."""

    def is_cancelled(self) -> bool: ...

    def writable(self) -> bool: ...

    def abandon(self) -> None:
        """The sender was released: end the request with an error if it is still open. Called
        from __del__, so it must take no lock."""


class ModelCaller(Protocol):
    """Where BLS calls go (the worker's side of them)."""

    def submit(
        self, request: InferenceRequest, decoupled: bool
    ) -> concurrent.futures.Future[InferenceResponse | ResponseIterator]:
        """Send the call; the future holds its response (an error response if it failed), or
        for a decoupled call an iterator of its responses, from any thread. Raises
        TritonModelException for a call that cannot be sent."""


_caller: ModelCaller | None = None


def set_model_caller(caller: ModelCaller) -> None:
    """The worker's: BLS calls of this process's model go to `caller`."""
    global _caller
    _caller = caller


class InferenceResponseSender:
    """Triton's per-request sender of a decoupled model; send() may be called from any
    thread, until the response with TRITONSERVER_RESPONSE_COMPLETE_FINAL."""

    def __init__(self, channel: ResponseChannel) -> None:
        self._channel = channel

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if flags == 0 and response is None:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero."
            )
        self._channel.send(response, flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self) -> bool:
        return self._channel.is_cancelled()

    def writable(self) -> bool:
        """paddlequic's extension: whether send() would return now rather than wait for the
        caller to take earlier responses (a scheduler pauses such a sequence instead of
        blocking the whole batch)."""
        return self._channel.writable()

    def __del__(self) -> None:
        self._channel.abandon()


class InferenceRequest:
    """One request as execute() receives it (a whole batch of rows, unless decoupled), or one
    a model builds to call another model (BLS: model_name, then exec() or async_exec())."""

    def __init__(
        self,
        inputs: Sequence[Tensor],
        requested_output_names: Sequence[str],
        request_id: str = "",
        parameters: str | Mapping[str, Any] | None = "{}",
        channel: ResponseChannel | None = None,
        *,
        model_name: str | bytes = "",
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        correlation_id: int | str = 0,
        preferred_memory: Any = None,
        trace: Any = None,
    ) -> None:
        """Triton's keywords; a BLS call's `timeout` is in microseconds (0: none of its own);
        flags and correlation_id are kept (a BLS call does not pass them on), preferred_memory
        and trace are accepted and ignored."""
        self._inputs = list(inputs)
        self._outputs = list(requested_output_names)
        self._request_id = request_id
        self._parameters = (
            parameters if isinstance(parameters, str) else json.dumps(dict(parameters or {}))
        )
        self._channel = channel
        # bytes as a BYTES input gives it (Triton's bls example passes as_numpy()[0]).
        self.model_name = model_name.decode() if isinstance(model_name, bytes) else model_name
        self.model_version = model_version
        self._timeout = timeout
        self._flags = flags
        self._correlation_id = correlation_id
        self._sender: InferenceResponseSender | None = None
        self._sender_lock = threading.Lock()

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._outputs)

    def get_input_tensor_by_name(self, name: str) -> Tensor | None:
        return get_input_tensor_by_name(self, name)

    def request_id(self) -> str:
        return self._request_id

    def timeout(self) -> int:
        """Microseconds (0: none of its own)."""
        return self._timeout

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = flags

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def trace(self) -> Any:
        _not_implemented("InferenceRequest.trace", "traces are the server's (--trace-*)")

    def set_release_flags(self, flags: int) -> None:
        _not_implemented(
            "InferenceRequest.set_release_flags", "a request cannot be rescheduled here"
        )

    def parameters(self) -> str:
        """The request's parameters as a JSON object, as Triton gives them."""
        return self._parameters

    def is_cancelled(self) -> bool:
        return self._channel is not None and self._channel.is_cancelled()

    def get_response_sender(self) -> InferenceResponseSender:
        """The same sender each call (Triton's one response factory per request)."""
        if self._channel is None:
            raise TritonModelException(
                "get_response_sender() needs a decoupled model "
                "(model_transaction_policy { decoupled: true } in config.pbtxt)"
            )
        with self._sender_lock:
            if self._sender is None:
                self._sender = InferenceResponseSender(self._channel)
            return self._sender

    def exec(self, decoupled: bool = False) -> Any:
        """Call `model_name` with this request and wait for its response (BLS); with
        `decoupled`, an iterator of every response it answered (the last one final)."""
        return _model_caller().submit(self, decoupled).result()

    def async_exec(self, decoupled: bool = False) -> _Awaitable:
        """Call `model_name` without waiting: await the result (in `async def execute`)."""
        return _Awaitable(_model_caller().submit(self, decoupled))

    def __del__(self) -> None:
        # Released without a sender ever taken: nothing can answer it any more.
        if self._channel is not None and self._sender is None:
            self._channel.abandon()


class _Awaitable:
    """What async_exec() returns: awaitable on any event loop, once."""

    def __init__(
        self, future: concurrent.futures.Future[InferenceResponse | ResponseIterator]
    ) -> None:
        self._future = future

    def __await__(self) -> Generator[Any, None, InferenceResponse | ResponseIterator]:
        return asyncio.wrap_future(self._future).__await__()


class ResponseIterator:
    """Triton's answer to exec(decoupled=True): the call's responses, each as the called model
    sends it (next() waits for the next one), the last one final (possibly without outputs).
    cancel() cancels the called model's request: the iterator then ends with the responses
    already on their way and a CANCELLED error response."""

    def __init__(
        self, responses: Iterable[InferenceResponse], cancel: Callable[[], None] = lambda: None
    ) -> None:
        self._responses = iter(responses)
        self._cancel = cancel

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        return next(self._responses)

    def cancel(self) -> None:
        self._cancel()


def _model_caller() -> ModelCaller:
    if _caller is None:
        raise TritonModelException(
            "BLS calls (InferenceRequest.exec) can be made from the execute() of a model "
            "that is not decoupled only"
        )
    return _caller


class InferenceResponse:
    def __init__(
        self,
        output_tensors: Iterable[Tensor] = (),
        error: TritonError | None = None,
        parameters: str | Mapping[str, Any] | None = None,
    ) -> None:
        """`parameters` are kept for parameters() and not sent to the caller."""
        self._outputs = list(output_tensors)
        self._error = error
        self._parameters = (
            parameters if isinstance(parameters, str) else json.dumps(dict(parameters or {}))
        )

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class _LogLevel:
    """Triton's levels of Logger.log (Logger.LogLevel.INFO, or Logger.INFO)."""

    INFO = "I"
    WARNING = "W"
    ERROR = "E"
    VERBOSE = "V"


class Logger:
    """Triton's logger of model.py: into the server's log, named for the model, at the level
    given (VERBOSE is the server's DEBUG), within the model's output budget."""

    LogLevel = _LogLevel
    INFO, WARNING, ERROR, VERBOSE = (
        _LogLevel.INFO,
        _LogLevel.WARNING,
        _LogLevel.ERROR,
        _LogLevel.VERBOSE,
    )

    @staticmethod
    def log(message: str, level: str = _LogLevel.INFO) -> None:
        if level not in model_log.LEVELS:
            raise TritonModelException(f"Logger.log: unknown level {level!r}; use Logger.LogLevel")
        sys.stderr.write(model_log.marked(level, str(message)))
        sys.stderr.flush()

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, _LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, _LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, _LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, _LogLevel.VERBOSE)


# A model's custom metrics, per worker (the front-end bounds them per model again).
MAX_METRIC_FAMILIES = 32
MAX_METRICS = 1024  # label sets, over all of its families
MAX_LABELS = 16  # per metric
MAX_METRIC_TEXT = 256  # characters of a name, label name or label value
MAX_DESCRIPTION = 1024
MAX_BUCKETS = 64
RESERVED_PREFIXES = ("paddlequic_", "process_", "python_")  # the server's own families
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class MetricOp(NamedTuple):
    """One change to a custom metric, as the worker sends it to the front-end."""

    family: str
    kind: str
    description: str
    labels: tuple[tuple[str, str], ...]
    buckets: tuple[float, ...]
    op: str  # "family", "metric" (declared), "increment", "set", "observe"
    value: float = 0.0


_metric_ops: list[MetricOp] = []  # made before the worker could send them (initialize)
_metric_sink: Callable[[MetricOp], None] | None = None
_metric_lock = threading.Lock()
_families: dict[str, MetricFamily] = {}
_metric_count = 0


def set_metric_sink(sink: Callable[[MetricOp], None]) -> None:
    """The worker's, once it may send: the ops made so far go first."""
    global _metric_sink
    with _metric_lock:
        _metric_sink = sink
        pending = list(_metric_ops)
        _metric_ops.clear()
    for op in pending:
        sink(op)


def _send_metric(op: MetricOp) -> None:
    with _metric_lock:
        sink = _metric_sink
        if sink is None:
            if len(_metric_ops) >= MAX_METRICS * 4:
                raise TritonModelException(
                    f"more than {MAX_METRICS * 4} metric updates before the model loaded"
                )
            _metric_ops.append(op)
            return
    sink(op)


def _checked_text(what: str, text: Any, pattern: re.Pattern[str] | None) -> str:
    if not isinstance(text, str) or len(text) > MAX_METRIC_TEXT:
        raise TritonModelException(
            f"{what} must be a string of at most {MAX_METRIC_TEXT} characters"
        )
    if pattern is not None and not pattern.fullmatch(text):
        raise TritonModelException(f"{what} {text!r} is not a valid Prometheus name")
    return text


class MetricFamily:
    """Triton's custom metric family, exported on the server's metrics endpoint beside the
    server's own families. Families are the server's, as in Triton: one of the same name and
    kind in another instance (or model) is the same family."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"

    def __init__(self, name: str, description: str, kind: str) -> None:
        _checked_text("MetricFamily name", name, _METRIC_NAME)
        if name.startswith(RESERVED_PREFIXES):
            raise TritonModelException(
                f"MetricFamily name {name!r} starts with one of the server's own prefixes "
                f"{list(RESERVED_PREFIXES)}"
            )
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise TritonModelException(
                "MetricFamily kind must be MetricFamily.COUNTER, GAUGE or HISTOGRAM"
            )
        if not isinstance(description, str) or len(description) > MAX_DESCRIPTION:
            raise TritonModelException(
                f"MetricFamily description must be a string of at most {MAX_DESCRIPTION} characters"
            )
        self.name: str = name
        self.description: str = description
        self.kind: str = kind
        with _metric_lock:
            known = _families.get(name)
            if known is None and len(_families) >= MAX_METRIC_FAMILIES:
                raise TritonModelException(
                    f"a model may define at most {MAX_METRIC_FAMILIES} metric families"
                )
            if known is not None and known.kind != kind:
                raise TritonModelException(
                    f"metric family {name!r} already exists as a {known.kind}, not a {kind}"
                )
            _families[name] = self
        _send_metric(MetricOp(name, kind, description, (), (), "family"))

    def Metric(
        self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None
    ) -> _Metric:
        """Triton's name: the metric of these labels (a histogram's with its buckets)."""
        return Metric(self, labels or {}, buckets)


class Metric:
    """One label set of a family. value() is what this model instance has counted, set or
    observed (a histogram's: the sum of its observations)."""

    def __init__(
        self, family: MetricFamily, labels: Mapping[str, str], buckets: Sequence[float] | None
    ) -> None:
        global _metric_count
        if len(labels) > MAX_LABELS:
            raise TritonModelException(f"a metric may have at most {MAX_LABELS} labels")
        pairs = tuple(
            sorted(
                (_checked_text("label name", k, _LABEL_NAME), _checked_text("label value", v, None))
                for k, v in labels.items()
            )
        )
        if family.kind == MetricFamily.HISTOGRAM:
            if buckets is None:
                raise TritonModelException("a HISTOGRAM metric needs buckets")
            bounds = tuple(float(b) for b in buckets)
            finite = all(math.isfinite(b) for b in bounds)
            if (
                not finite
                or not 0 < len(bounds) <= MAX_BUCKETS
                or list(bounds) != sorted(set(bounds))
            ):
                raise TritonModelException(
                    f"buckets must be 1 to {MAX_BUCKETS} increasing finite numbers"
                )
        elif buckets is not None:
            raise TritonModelException("only a HISTOGRAM metric has buckets")
        else:
            bounds = ()
        with _metric_lock:
            if _metric_count >= MAX_METRICS:
                raise TritonModelException(f"a model may create at most {MAX_METRICS} metrics")
            _metric_count += 1
        self._family, self._labels, self._buckets = family, pairs, bounds
        self._value = 0.0
        self._lock = threading.Lock()
        self._send("metric", 0.0)

    def increment(self, value: float) -> None:
        kind = self._family.kind
        if kind == MetricFamily.HISTOGRAM or (kind == MetricFamily.COUNTER and value < 0):
            raise TritonModelException(f"increment() of a {kind} takes a non-negative value")
        self._change("increment", float(value))

    def set(self, value: float) -> None:
        if self._family.kind != MetricFamily.GAUGE:
            raise TritonModelException(f"set() is for a gauge, not a {self._family.kind}")
        self._change("set", float(value))

    def observe(self, value: float) -> None:
        if self._family.kind != MetricFamily.HISTOGRAM:
            raise TritonModelException(f"observe() is for a histogram, not a {self._family.kind}")
        self._change("observe", float(value))

    def value(self) -> float:
        with self._lock:
            return self._value

    def _change(self, op: str, value: float) -> None:
        if not math.isfinite(value):
            raise TritonModelException(f"{op}() takes a finite number, not {value}")
        with self._lock:
            self._value = value if op == "set" else self._value + value
        self._send(op, value)

    def _send(self, op: str, value: float) -> None:
        family = self._family
        _send_metric(
            MetricOp(
                family.name, family.kind, family.description, self._labels, self._buckets, op, value
            )
        )


class ModelConfig:
    """Triton's config as auto_complete_config(auto_complete_model_config) receives it: the
    config JSON, completed by the model's calls and returned. What it may set: max_batch_size,
    inputs, outputs, dynamic batching and the transaction policy; what config.pbtxt says
    already wins, and a contradiction is a ValueError that fails the load."""

    def __init__(self, model_config: str | Mapping[str, Any]) -> None:
        self._model_config: dict[str, Any] = (
            json.loads(model_config) if isinstance(model_config, str) else dict(model_config)
        )
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        configured = self._model_config["max_batch_size"]
        if configured > max_batch_size:
            raise ValueError(
                f"model '{self._name()}': config.pbtxt sets max_batch_size {configured}, "
                f"auto_complete_config sets {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"model '{self._name()}': config.pbtxt sets {other}, auto_complete_config "
                    "sets dynamic_batching"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: Mapping[str, Any]) -> None:
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: Mapping[str, Any]) -> None:
        self._add("output", output, ("name", "data_type", "dims"))

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        unknown = set(transaction_policy_dict) - {"decoupled"}
        if unknown:
            raise ValueError(
                f"model '{self._name()}': model_transaction_policy has no {sorted(unknown)}"
            )
        current = self._model_config.setdefault("model_transaction_policy", {})
        wanted = bool(transaction_policy_dict.get("decoupled", False))
        if "decoupled" in current and bool(current["decoupled"]) != wanted:
            raise ValueError(
                f"model '{self._name()}': config.pbtxt sets decoupled "
                f"{bool(current['decoupled'])}, auto_complete_config sets {wanted}"
            )
        current["decoupled"] = wanted

    def _add(self, kind: str, entry: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
        extra = sorted(set(entry) - set(allowed))
        missing = [p for p in allowed[:3] if p not in entry]
        if extra or missing:
            raise ValueError(
                f"model '{self._name()}': {kind} {entry.get('name')!r} of auto_complete_config "
                f"must have {list(allowed[:3])}"
                + (" (and may have 'optional')" if kind == "input" else "")
                + f"; it has {sorted(entry)}"
            )
        added = dict(entry)
        added["dims"] = [int(d) for d in added["dims"]]
        for current in self._model_config[kind]:
            if current["name"] != added["name"]:
                continue
            for prop in allowed[1:]:
                given = current.get(prop)
                if (
                    prop in added
                    and given not in (None, "TYPE_INVALID", [])
                    and given != added[prop]
                ):
                    raise ValueError(
                        f"model '{self._name()}': {kind} {added['name']!r} has {prop} {given} "
                        f"in config.pbtxt, {added[prop]} in auto_complete_config"
                    )
            current.update(added)
            return
        self._model_config[kind].append(added)

    def _name(self) -> str:
        return str(self._model_config.get("name", ""))


_Metric = Metric  # MetricFamily.Metric's type (its name is the method's in that class)


def using_decoupled_model_transaction_policy(model_config: Any) -> bool:
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    return bool(config.get("model_transaction_policy", {}).get("decoupled", False))


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: Any, name: str) -> dict[str, Any] | None:
    return _config_entry(model_config, "input", name)


def get_output_config_by_name(model_config: Any, name: str) -> dict[str, Any] | None:
    return _config_entry(model_config, "output", name)


def triton_string_to_numpy(triton_type: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type]


def triton_to_numpy_type(data_type: int) -> Any:
    """A TRITONSERVER data type number's numpy type (None for one numpy lacks)."""
    return _NUMPY_OF_NUMBER.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    """A numpy type's TRITONSERVER data type number (bytes_ is BYTES, as object_ is)."""
    if data_type in (np.object_, np.bytes_):
        return _NUMBER_OF_TYPE["TYPE_STRING"]
    return next((n for n, t in _NUMPY_OF_NUMBER.items() if t == data_type), None)


def serialize_byte_tensor(input_tensor: np.ndarray[Any, Any]) -> Any:
    """Triton's BYTES wire form: each element, in C order, after its length as 4 bytes
    little-endian (str elements UTF-8 encoded); () for an empty tensor, None for one that
    is not of bytes."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    parts = []
    for item in input_tensor.flatten(order="C"):
        data = item if isinstance(item, bytes) else str(item).encode()
        parts += [struct.pack("<I", len(data)), data]
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray[Any, Any]:
    """serialize_byte_tensor's inverse: a 1-D object array of bytes."""
    items, offset = [], 0
    while offset < len(encoded_tensor):
        (size,) = struct.unpack_from("<I", encoded_tensor, offset)
        items.append(bytes(encoded_tensor[offset + 4 : offset + 4 + size]))
        offset += 4 + size
    array = np.empty(len(items), dtype=np.object_)
    array[:] = items
    return array


def load_model(model_name: str, config: str = "", files: Any = None) -> None:
    _not_implemented("load_model", "models are loaded by the server (its control API)")


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    _not_implemented("unload_model", "models are unloaded by the server (its control API)")


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    _not_implemented("is_model_ready", "a BLS call to a model that is not ready fails")


def _not_implemented(name: str, instead: str) -> NoReturn:
    """A part of Triton's API paddlequic does not implement, named when it is called (never
    an AttributeError when model.py is imported)."""
    raise TritonModelException(f"pb_utils.{name} is not implemented by paddlequic: {instead}")


def _config_entry(model_config: Any, kind: str, name: str) -> dict[str, Any] | None:
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    return next((e for e in config.get(kind, []) if e.get("name") == name), None)
