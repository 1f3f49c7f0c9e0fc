"""What travels in an instance's rings: requests (and cancellations) from the process holding
the calls to the worker, and each request's answer or failure back.

Names are indexes into the lists the worker was given with its queues (QueueSetup), so a
record holds shapes, bytes and a few numbers. A reply is read as hostile input (the worker
runs model code): `read_reply` checks every count, index, shape and length against what the
request asked for and raises Corrupt on the first that does not hold.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from service.inference.jobs import Timings
from service.queues.ring import Corrupt, RingWriter, aligned8

REQUEST, CANCEL = 1, 2
ANSWER, FAILURE = 1, 2
COUNTS_BATCH = 1  # an answer's code: see Reply.counts_batch
ALONE = 1  # flags: runs in a batch of its own (after its worker died running it)
# A failure's kind, which the reader turns into a status.
FAILED, TOO_LARGE, EXPIRED, CANCELLED = 0, 1, 2, 3
MAX_RANK = 16
MAX_DIM = 1 << 40
MAX_FAILURE_TEXT = 4000
NO_TIME = math.nan

_REQUEST = struct.Struct("<BBHHHIQdd")  # kind, flags, inputs, outputs, priority, rows, id, ...
_CANCEL = struct.Struct("<BxxxxxxxQ")
_TENSOR = struct.Struct("<HHIQ")  # index, rank, 0, nbytes; then rank dims, then the data
_REPLY = struct.Struct("<BBHIQQQQQQ")  # kind, code, outputs, batch rows, id, batch, timings
_TEXT = struct.Struct("<I4x")


class Tensor(NamedTuple):  # a tuple: one per tensor of every record, built fast
    position: int  # into the setup's inputs or outputs
    shape: tuple[int, ...]
    data: memoryview


class Request(NamedTuple):
    id: int
    flags: int
    priority: int
    batch_size: int
    expires: float | None  # the request's queue timeout or deadline (CLOCK_MONOTONIC)
    deadline: float | None
    outputs: tuple[int, ...]
    inputs: tuple[Tensor, ...]


@dataclass(frozen=True)
class Cancel:
    id: int


class Reply(NamedTuple):
    id: int
    batch: int  # the worker's batch number
    batch_rows: int  # the rows its requests brought
    timings: Timings
    queue_ns: int  # in the worker's queue
    outputs: tuple[Tensor, ...] = ()
    failure: int | None = None  # FAILED, TOO_LARGE, EXPIRED or CANCELLED; None: answered
    text: str = ""
    # The batch's first answer, over all the worker's callers: the one process that counts
    # the batch (statistics, metrics, its span) when several hold its requests.
    counts_batch: bool = False


_HEADS = [struct.Struct(f"<HHIQ{rank}Q") for rank in range(MAX_RANK + 1)]  # _TENSOR + dims
_INDEXES = [struct.Struct(f"<{count}H") for count in range(64)]
_REQUEST_AT = aligned8(_REQUEST.size)


def _indexes(count: int) -> struct.Struct:
    return _INDEXES[count] if count < len(_INDEXES) else struct.Struct(f"<{count}H")


def _tensor_size(shape: Sequence[int], nbytes: int) -> int:
    return _TENSOR.size + 8 * len(shape) + ((nbytes + 7) & ~7)


def _pack_tensor(buf: memoryview, at: int, index: int, shape: Sequence[int], data: bytes) -> int:
    """One tensor at `at`: its header and dims, then its bytes; where the next one goes."""
    head = _HEADS[len(shape)]
    nbytes = len(data)
    head.pack_into(buf, at, index, len(shape), 0, nbytes, *shape)
    at += head.size
    buf[at : at + nbytes] = data
    return at + ((nbytes + 7) & ~7)


def request_size(shapes: Sequence[tuple[tuple[int, ...], int]], outputs: int) -> int:
    """The payload bytes of a request with inputs of these (shape, nbytes)."""
    size = _REQUEST_AT + ((2 * outputs + 7) & ~7)
    for shape, nbytes in shapes:
        size += _TENSOR.size + 8 * len(shape) + ((nbytes + 7) & ~7)
    return size


def write_request(
    ring: RingWriter,
    request_id: int,
    inputs: Sequence[tuple[int, tuple[int, ...], bytes]],
    outputs: Sequence[int],
    priority: int,
    batch_size: int,
    expires: float | None,
    deadline: float | None,
    flags: int = 0,
) -> bool:
    """The request into the ring; False while the ring is full."""
    size = request_size([(shape, len(data)) for _, shape, data in inputs], len(outputs))
    buf = ring.reserve(size)
    if buf is None:
        return False
    _REQUEST.pack_into(
        buf,
        0,
        REQUEST,
        flags,
        len(inputs),
        len(outputs),
        priority,
        batch_size,
        request_id,
        NO_TIME if expires is None else expires,
        NO_TIME if deadline is None else deadline,
    )
    at = _REQUEST_AT
    _indexes(len(outputs)).pack_into(buf, at, *outputs)
    at += (2 * len(outputs) + 7) & ~7
    for index, shape, data in inputs:
        at = _pack_tensor(buf, at, index, shape, data)
    buf.release()
    ring.commit()
    return True


def write_cancel(ring: RingWriter, request_id: int) -> bool:
    buf = ring.reserve(_CANCEL.size)
    if buf is None:
        return False
    _CANCEL.pack_into(buf, 0, CANCEL, request_id)
    buf.release()
    ring.commit()
    return True


def _time(value: float) -> float | None:
    return None if math.isnan(value) else value


def _tensors(payload: memoryview, at: int, count: int) -> tuple[tuple[Tensor, ...], int]:
    tensors = []
    for _ in range(count):
        if at + _TENSOR.size > len(payload):
            raise Corrupt("a tensor past the record's end")
        index, rank, _, nbytes = _TENSOR.unpack_from(payload, at)
        at += _TENSOR.size
        if rank > MAX_RANK or at + 8 * rank + nbytes > len(payload):
            raise Corrupt(f"a tensor of rank {rank} and {nbytes} bytes past the record's end")
        shape = _HEADS[rank].unpack_from(payload, at - _TENSOR.size)[4:]
        at += 8 * rank
        if any(d > MAX_DIM for d in shape):
            raise Corrupt(f"a tensor of shape {list(shape)}")
        tensors.append(Tensor(index, shape, payload[at : at + nbytes]))
        at += aligned8(nbytes)
    return tuple(tensors), at


def read_request(payload: bytes) -> Request | Cancel:
    """A record the process holding the calls wrote (in the worker)."""
    view = memoryview(payload)
    if view[0] == CANCEL:
        return Cancel(_CANCEL.unpack_from(view)[1])
    kind, flags, n_in, n_out, priority, rows, request_id, expires, deadline = _REQUEST.unpack_from(
        view
    )
    if kind != REQUEST:
        raise Corrupt(f"a record of kind {kind}")
    at = _REQUEST_AT
    outputs = _indexes(n_out).unpack_from(view, at)
    at += (2 * n_out + 7) & ~7
    inputs, _ = _tensors(view, at, n_in)
    return Request(
        request_id, flags, priority, rows, _time(expires), _time(deadline), outputs, inputs
    )


def reply_size(outputs: Sequence[tuple[tuple[int, ...], int]]) -> int:
    return _REPLY.size + sum(_tensor_size(shape, nbytes) for shape, nbytes in outputs)


def write_answer(
    buf: memoryview,
    request_id: int,
    batch: int,
    batch_rows: int,
    timings: Timings,
    queue_ns: int,
    outputs: Sequence[tuple[int, tuple[int, ...], bytes]],
    counts_batch: bool = True,
) -> None:
    """Into room of reply_size() bytes reserved in the reply ring."""
    _REPLY.pack_into(
        buf,
        0,
        ANSWER,
        COUNTS_BATCH if counts_batch else 0,
        len(outputs),
        batch_rows,
        request_id,
        batch,
        timings.input_ns,
        timings.infer_ns,
        timings.output_ns,
        queue_ns,
    )
    at = _REPLY.size
    for index, shape, data in outputs:
        at = _pack_tensor(buf, at, index, shape, data)


def failure_bytes(request_id: int, kind: int, text: str) -> bytes:
    data = text.encode()[:MAX_FAILURE_TEXT]
    head = _REPLY.pack(FAILURE, kind, 0, 0, request_id, 0, 0, 0, 0, 0)
    return head + _TEXT.pack(len(data)) + data


@dataclass(frozen=True)
class Expected:
    """What the reply to one request may hold: the outputs it asked for, each with its
    element size, and the rows each must start with (0: the model does not batch)."""

    outputs: tuple[int, ...]
    itemsizes: tuple[int, ...]  # by output index (the setup's outputs)
    rows: int
    max_batch_rows: int


def _reply_head(payload: bytes | memoryview) -> tuple[int, ...]:
    if len(payload) < _REPLY.size:
        raise Corrupt(f"a reply of {len(payload)} bytes")
    return _REPLY.unpack_from(payload)


def request_id_of(payload: bytes) -> int:
    return int(_reply_head(payload)[4])


def read_reply(payload: bytes, expected: Expected) -> Reply:
    """A record the worker wrote, checked against what its request asked for."""
    view = memoryview(payload)
    kind, code, n_out, rows, request_id, batch, t_in, t_run, t_out, queued = _reply_head(view)
    if kind == FAILURE:
        if code not in (FAILED, TOO_LARGE, EXPIRED, CANCELLED):
            raise Corrupt(f"a failure of kind {code}")
        start = _REPLY.size + _TEXT.size
        if len(view) < start:
            raise Corrupt(f"a failure of {len(view)} bytes")
        (length,) = _TEXT.unpack_from(view, _REPLY.size)
        if length > MAX_FAILURE_TEXT or start + length != len(view):
            raise Corrupt(f"a failure text of {length} bytes in a record of {len(view)}")
        text = bytes(view[start:]).decode(errors="replace")
        return Reply(request_id, 0, 0, Timings(0, 0, 0), 0, failure=code, text=text)
    if kind != ANSWER:
        raise Corrupt(f"a reply of kind {kind}")
    if code not in (0, COUNTS_BATCH):
        raise Corrupt(f"an answer with code {code}")
    if not 0 < rows <= expected.max_batch_rows:
        raise Corrupt(f"a batch of {rows} rows; the model takes {expected.max_batch_rows}")
    outputs, end = _tensors(view, _REPLY.size, n_out)
    if end != len(view):
        raise Corrupt("bytes after the reply's last output")
    if sorted(t.position for t in outputs) != sorted(expected.outputs):
        sent = [t.position for t in outputs]
        raise Corrupt(f"outputs {sent} for a request of {list(expected.outputs)}")
    for tensor in outputs:
        if len(tensor.data) != math.prod(tensor.shape) * expected.itemsizes[tensor.position]:
            raise Corrupt(f"an output of shape {list(tensor.shape)} in {len(tensor.data)} bytes")
        if expected.rows and (not tensor.shape or tensor.shape[0] != expected.rows):
            raise Corrupt(f"an output of shape {list(tensor.shape)} for {expected.rows} rows")
    timings = Timings(*(min(t, _MAX_NS) for t in (t_in, t_run, t_out)))
    return Reply(
        request_id, batch, rows, timings, min(queued, _MAX_NS), outputs, counts_batch=bool(code)
    )


_MAX_NS = 3600 * 10**9  # a worker's timings are its own word: bounded so statistics stay sane
