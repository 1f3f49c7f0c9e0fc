"""Messages between the front-end and a worker process, and their framing on the socket.

Only small descriptors cross the socket; tensor bytes live in shared memory (shm.py). Messages
are pickles, but a worker may run untrusted model.py code that writes to its socket, so they are
read back with an unpickler that builds only the classes below (no callable, no import), and
each header is checked against the most the worker may send now (message_bounds.py) before its
body is read.
"""

from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass, field

from service.backend.load import Load
from service.batching.queue import BatchPolicy
from service.inference.jobs import Timings
from service.inference.tensors import TensorSpec
from service.model.shapes import ShapeBuckets
from service.queues.layout import QueueLayout

_HEADER = struct.Struct("<I")
MAX_MESSAGE = 1 << 31


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lies in a shared-memory segment."""

    name: str
    dtype: str  # numpy dtype string, e.g. "<f4"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Loaded:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    device: str
    # A Python model's sandbox: what the host could not provide; None: not sandboxed.
    unprotected: tuple[str, ...] | None = None
    # A Python model's config as its auto_complete_config completed it (empty: it has none).
    config: bytes = b""


@dataclass(frozen=True)
class LoadFailed:
    reason: str


@dataclass(frozen=True)
class Infer:
    request_id: int
    input_segment: str
    output_segment: str
    output_capacity: int
    inputs: tuple[TensorRef, ...]
    outputs: tuple[str, ...]
    retired: tuple[str, ...] = ()  # segments the front-end released: unmap them
    # The most output bytes the Result may carry inline (message_bounds.py): more fails the
    # batch in the worker, as the front-end would kill a worker that sent them.
    inline_capacity: int = 0


@dataclass(frozen=True)
class Result:
    request_id: int
    timings: Timings
    outputs: tuple[TensorRef, ...]  # in the output segment
    # Outputs that did not fit the output segment travel inline; rare, and the front-end grows
    # the segment for next time.
    inline: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Failed:
    request_id: int
    message: str
    # The outputs were more than the batch's callers may receive (Infer.inline_capacity):
    # RESOURCE_EXHAUSTED, as a response over --max-message-bytes is.
    too_large: bool = False


@dataclass(frozen=True)
class Submit:
    """One request of a decoupled model (never batched with others: the model answers it with
    zero to many Responses). Its input bytes travel inline, so it holds no slot while the
    model works on it."""

    request_id: int
    inputs: tuple[TensorRef, ...]  # offsets into `data`
    data: bytes
    outputs: tuple[str, ...]
    id: str  # the caller's request id (pb_utils' request.request_id())
    parameters: str  # the request's parameters as JSON (pb_utils' request.parameters())


@dataclass(frozen=True)
class Response:
    """One response of a decoupled request; `final` ends it (with outputs or without)."""

    request_id: int
    outputs: tuple[TensorRef, ...]  # offsets into `data`
    data: bytes
    final: bool
    error: str | None = None  # the model's TritonError, or why the request failed in the worker
    error_code: int = 1  # its TRITONSERVER_Error_Code (pb_utils.TritonError's codes): INTERNAL


@dataclass(frozen=True)
class Credit:
    """The server took `count` more responses of the request: the worker may send as many more
    (the worker holds a sender that has RESPONSE_WINDOW unread responses out)."""

    request_id: int
    count: int


@dataclass(frozen=True)
class Cancel:
    """The caller went away or its deadline passed: the model's is_cancelled() turns true, and
    the worker sends nothing more for the request (not even its final Response), whatever the
    model still sends; a Response already on its way may still arrive."""

    request_id: int


@dataclass(frozen=True)
class BlsCall:
    """A Python model's BLS call (pb_utils.InferenceRequest.exec()), made while the worker
    runs request `caller`; its input bytes travel inline. The server answers each call with
    exactly one BlsAnswer without `more` while the worker lives."""

    call_id: int
    caller: int  # the Infer the model is running
    model: str
    version: str  # "": the newest ready version
    inputs: tuple[TensorRef, ...]  # offsets into `data`
    data: bytes
    outputs: tuple[str, ...]
    timeout_us: int  # Triton's `timeout`; 0: none of its own (the caller's deadline holds)
    decoupled: bool = False  # exec(decoupled=True): answered with each response as it comes


@dataclass(frozen=True)
class BlsPart:
    """One response of a decoupled BLS call (its outputs in its BlsAnswer's `data`)."""

    outputs: tuple[TensorRef, ...]
    error: str | None = None
    error_code: int = 1


@dataclass(frozen=True)
class BlsAnswer:
    """The answer to a BlsCall: the target's outputs, or its error. A decoupled call's
    responses come each in its own answer with `more` (one part), in order; the answer without
    `more` ends the call (no part, or the error that ended it)."""

    call_id: int
    outputs: tuple[TensorRef, ...]  # offsets into `data`
    data: bytes
    error: str | None = None
    error_code: int = 1  # pb_utils.TritonError's code (TRITONSERVER_Error_Code)
    parts: tuple[BlsPart, ...] | None = None
    more: bool = False


@dataclass(frozen=True)
class BlsCancel:
    """The model cancelled its decoupled BLS call (ResponseIterator.cancel()): the target's
    request is cancelled; the call still ends with its BlsAnswer without `more`."""

    call_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Queues:
    """From now on the worker takes its requests from shared-memory rings and batches them
    itself (service/workers/queued_loop.py); the segment and its two wake-up descriptors (in,
    out) come next on the segments channel."""

    layout: QueueLayout
    policy: BatchPolicy  # what batches it forms (max_queue_size: the caller's bound, not its)
    inputs: tuple[tuple[str, str], ...]  # (name, datatype) by the index requests use
    outputs: tuple[str, ...]  # the program's fetch names by the index requests use


@dataclass(frozen=True)
class AddProducer:
    """One more process holding calls writes into this worker's queues (a front-end, under
    `producer`, replacing any it had): its segment and wake-up descriptors come next on the
    segments channel, laid out as the first Queues said."""

    producer: int


@dataclass(frozen=True)
class DropProducer:
    """That process is gone: its requests are dropped unanswered and its segment unmapped."""

    producer: int


@dataclass(frozen=True)
class Served:
    """A decoupled worker sent its first data response to a front-end (whose responses never
    cross the server's socket): once per front-end and launch, so that a death after it is a
    serving worker's, restarted at once (restarts.py)."""


@dataclass(frozen=True)
class MetricUpdate:
    """One change to a Python model's custom metric (pb_utils.MetricFamily / Metric): what the
    worker checked, which the front-end checks again (service/workers/model_metrics.py)."""

    family: str
    kind: str  # "counter", "gauge", "histogram"
    description: str
    labels: tuple[tuple[str, str], ...]
    buckets: tuple[float, ...]
    op: str  # "family", "metric" (declared), "increment", "set", "observe"
    value: float = 0.0


# Data responses of one decoupled request the worker may have sent and the server not yet
# taken (Credits return them); the final Response needs no credit.
RESPONSE_WINDOW = 8
# The tensor bytes one BLS call or answer may carry inline: more is refused with an error.
BLS_MAX_BYTES = 64 << 20

Message = (
    Load
    | Loaded
    | LoadFailed
    | Infer
    | Result
    | Failed
    | Submit
    | Response
    | Credit
    | Cancel
    | BlsCall
    | BlsAnswer
    | BlsCancel
    | Shutdown
    | MetricUpdate
    | Queues
    | AddProducer
    | DropProducer
    | Served
)


def encode(message: Message) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def header_size() -> int:
    return _HEADER.size


class Oversized(ValueError):
    """A header declaring more than its reader takes; nothing after the header was read."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"a message of {size} bytes, more than the {limit} it may send now")
        self.size = size
        self.limit = limit


def body_size(header: bytes, limit: int = MAX_MESSAGE) -> int:
    """The size the header declares; Oversized above `limit`."""
    (size,) = _HEADER.unpack(header)
    if size > min(limit, MAX_MESSAGE):
        raise Oversized(size, min(limit, MAX_MESSAGE))
    return int(size)


_MESSAGES = (
    Load,
    Loaded,
    LoadFailed,
    Infer,
    Result,
    Failed,
    Submit,
    Response,
    Credit,
    Cancel,
    BlsCall,
    BlsAnswer,
    BlsCancel,
    Shutdown,
    MetricUpdate,
    Queues,
    AddProducer,
    DropProducer,
    Served,
)
_CLASSES = {
    (cls.__module__, cls.__qualname__): cls
    for cls in (
        *_MESSAGES,
        TensorRef,
        TensorSpec,
        Timings,
        ShapeBuckets,
        BlsPart,
        QueueLayout,
        BatchPolicy,
    )
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        cls = _CLASSES.get((module, name))
        if cls is None:
            raise pickle.UnpicklingError(f"worker message refers to {module}.{name}")
        return cls


def decode(body: bytes) -> Message:
    message = _Unpickler(io.BytesIO(body)).load()
    if not isinstance(message, _MESSAGES):
        raise ValueError(f"unexpected worker message {type(message).__name__}")
    return message
