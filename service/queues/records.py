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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

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
# kind, code, outputs, batch rows, requests answered, batch, timings; then each request's
# (id, queue ns), then the outputs
_ANSWERS = struct.Struct("<BBHIQQQQQ")
_ANSWERED = struct.Struct("<QQ")
_FAILURE = struct.Struct("<BBxxxxxxQI4x")  # kind, failure kind, id, text bytes; then the text


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


class Reply(NamedTuple):  # one request's
    id: int
    batch: int  # the worker's batch number
    batch_rows: int  # the rows its requests brought
    timings: Timings
    queue_ns: int  # in the worker's queue
    outputs: tuple[Tensor, ...] = ()
    failure: int | None = None  # FAILED, TOO_LARGE, EXPIRED or CANCELLED; None: answered
    text: str = ""
    # The batch's first answer, over all the worker's callers: the one process that counts
    # the batch (statistics, metrics, its span) when several hold its requests (in a record
    # of several answers, its first).
    counts_batch: bool = False


_HEADS = [struct.Struct(f"<HHIQ{rank}Q") for rank in range(MAX_RANK + 1)]  # _TENSOR + dims
_DIMS = [struct.Struct(f"<{rank}Q") for rank in range(MAX_RANK + 1)]
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


def _tensors(payload: memoryview, at: int, count: int) -> tuple[tuple[Tensor, ...], int]:
    tensors = []
    end = len(payload)
    for _ in range(count):
        if at + _TENSOR.size > end:
            raise Corrupt("a tensor past the record's end")
        index, rank, _, nbytes = _TENSOR.unpack_from(payload, at)
        at += _TENSOR.size
        if rank > MAX_RANK or at + 8 * rank + nbytes > end:
            raise Corrupt(f"a tensor of rank {rank} and {nbytes} bytes past the record's end")
        shape = _DIMS[rank].unpack_from(payload, at)
        at += 8 * rank
        if rank and max(shape) > MAX_DIM:
            raise Corrupt(f"a tensor of shape {list(shape)}")
        tensors.append(Tensor(index, shape, payload[at : at + nbytes]))
        at += (nbytes + 7) & ~7
    return tuple(tensors), at


def read_request(payload: bytes | memoryview) -> Request | Cancel:
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
        request_id,
        flags,
        priority,
        rows,
        None if expires != expires else expires,  # NaN: none (inline: once per request)
        None if deadline != deadline else deadline,
        outputs,
        inputs,
    )


class RunInput(NamedTuple):
    position: int  # into the setup's inputs
    shape: tuple[int, ...]  # each request's
    data: bytes  # every request's bytes of it, one after the other


class Run(NamedTuple):
    """Requests that came one after the other in the same form (every field the same but
    their ids, times and tensors' bytes): the worker takes them at once, each input as one
    array of all of theirs, instead of request by request."""

    ids: list[int]
    expires: list[float | None]
    deadlines: list[float | None]
    flags: int
    priority: int
    batch_size: int
    outputs: tuple[int, ...]
    inputs: tuple[RunInput, ...]


_VARYING = struct.Struct("<Qdd")  # id, expires, deadline: what a run's requests may differ in
_VARYING_AT = struct.calcsize("<BBHHHI")  # where they are: after _REQUEST's first six fields


def read_requests(payloads: Sequence[bytes | memoryview]) -> list[Run | Cancel]:
    """The records the process holding the calls wrote, in order (in the worker): consecutive
    requests of one form as one Run. Each run's first request is read and checked as
    read_request does; a request after it joins the run only where its length and every byte
    that is not an id, a time or a tensor's data are the first one's, so it holds the same."""
    taken: list[Run | Cancel] = []
    index, count = 0, len(payloads)
    while index < count:
        payload = payloads[index]
        record = read_request(payload)
        if isinstance(record, Cancel):
            taken.append(record)
            index += 1
            continue
        end = index + 1
        size, head = len(payload), payload[:_VARYING_AT]
        # The next one's length and first fields before the whole form is built: requests of
        # forms taking turns (another priority, other outputs) are each a run of one.
        if end < count and len(payloads[end]) == size and payloads[end][:_VARYING_AT] == head:
            form = _form(payload, record)
            while end < count and len(after := payloads[end]) == size:
                for start, stop, same in form:
                    if after[start:stop] != same:
                        break
                else:
                    end += 1
                    continue
                break
        taken.append(_run(record, payloads[index:end]))
        index = end
    return taken


def _layout(record: Request) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Where a request's fixed bytes are (all but its id and times, the padding, which a
    writer leaves as it was, and its tensors' data), and where each tensor's data is."""
    fixed = [(0, _VARYING_AT), (_REQUEST_AT, _REQUEST_AT + 2 * len(record.outputs))]
    data = []
    at = _REQUEST_AT + ((2 * len(record.outputs) + 7) & ~7)
    for tensor in record.inputs:
        start = at + _TENSOR.size + 8 * len(tensor.shape)
        fixed.append((at, start))
        data.append((start, start + len(tensor.data)))
        at = start + ((len(tensor.data) + 7) & ~7)
    return fixed, data


def _form(payload: bytes | memoryview, record: Request) -> list[tuple[int, int, bytes]]:
    """The bytes every other request of the run must hold as this one does."""
    return [(a, b, bytes(payload[a:b])) for a, b in _layout(record)[0]]


def _run(first: Request, payloads: Sequence[bytes | memoryview]) -> Run:
    if len(payloads) == 1:  # copied, as a run's joined bytes are: no view keeps the take's copy
        inputs = tuple(RunInput(t.position, t.shape, bytes(t.data)) for t in first.inputs)
        return Run(
            [first.id],
            [first.expires],
            [first.deadline],
            first.flags,
            first.priority,
            first.batch_size,
            first.outputs,
            inputs,
        )
    varying = [_VARYING.unpack_from(payload, _VARYING_AT) for payload in payloads]
    inputs = tuple(
        RunInput(t.position, t.shape, b"".join([payload[a:b] for payload in payloads]))
        for t, (a, b) in zip(first.inputs, _layout(first)[1], strict=True)
    )
    return Run(
        [v[0] for v in varying],
        [None if v[1] != v[1] else v[1] for v in varying],  # NaN: none
        [None if v[2] != v[2] else v[2] for v in varying],
        first.flags,
        first.priority,
        first.batch_size,
        first.outputs,
        inputs,
    )


def answers_size(count: int, outputs: Sequence[tuple[tuple[int, ...], int]]) -> int:
    """The payload bytes of the answers to `count` requests with outputs of these (shape,
    nbytes): every request's rows of an output together."""
    return (
        _ANSWERS.size
        + _ANSWERED.size * count
        + sum(_tensor_size(shape, nbytes) for shape, nbytes in outputs)
    )


def write_answers(
    buf: memoryview,
    batch: int,
    batch_rows: int,
    timings: Timings,
    counts_batch: bool,
    answered: Sequence[tuple[int, int]],
    outputs: Sequence[tuple[int, tuple[int, ...], Any]],
) -> None:
    """Into room of answers_size() bytes reserved in the reply ring: the answers to requests
    (id, ns in the worker's queue) that asked for the same outputs, in one record, each
    output their rows in that order (the whole output for one request of a model that does
    not batch)."""
    _ANSWERS.pack_into(
        buf,
        0,
        ANSWER,
        COUNTS_BATCH if counts_batch else 0,
        len(outputs),
        batch_rows,
        len(answered),
        batch,
        timings.input_ns,
        timings.infer_ns,
        timings.output_ns,
    )
    at = _ANSWERS.size
    for request_id, queue_ns in answered:
        _ANSWERED.pack_into(buf, at, request_id, queue_ns)
        at += _ANSWERED.size
    for index, shape, data in outputs:
        at = _pack_tensor(buf, at, index, shape, data)


def failure_bytes(request_id: int, kind: int, text: str) -> bytes:
    data = text.encode()[:MAX_FAILURE_TEXT]
    return _FAILURE.pack(FAILURE, kind, request_id, len(data)) + data


@dataclass(frozen=True)
class Expected:
    """What the reply to one request may hold: the outputs it asked for, each with its
    element size, and the rows each must start with (0: the model does not batch)."""

    outputs: tuple[int, ...]
    itemsizes: tuple[int, ...]  # by output index (the setup's outputs)
    rows: int
    max_batch_rows: int


# What the process reading replies expects of a request it sent; None: it sent no such request.
ExpectedOf = Callable[[int], "Expected | None"]


def read_reply(payload: bytes, expected_of: ExpectedOf) -> list[Reply]:
    """A record the worker wrote (one failure, or the answers to one or more requests),
    checked against what each of its requests asked for."""
    view = memoryview(payload)
    if len(view) < 1:
        raise Corrupt("a reply of 0 bytes")
    if view[0] == FAILURE:
        return [_failure(view, expected_of)]
    if view[0] != ANSWER:
        raise Corrupt(f"a reply of kind {view[0]}")
    if len(view) < _ANSWERS.size:
        raise Corrupt(f"a reply of {len(view)} bytes")
    _, code, n_out, rows, count, batch, t_in, t_run, t_out = _ANSWERS.unpack_from(view)
    if code not in (0, COUNTS_BATCH):
        raise Corrupt(f"an answer with code {code}")
    at = _ANSWERS.size + _ANSWERED.size * count
    if not count or at > len(view):
        raise Corrupt(f"answers to {count} requests in a record of {len(view)} bytes")
    answered = [
        _ANSWERED.unpack_from(view, _ANSWERS.size + _ANSWERED.size * i) for i in range(count)
    ]
    first = _expected(expected_of, answered[0][0])
    wanted = [first]
    if count > 1:
        if count > (first.rows and first.max_batch_rows):
            raise Corrupt(f"answers to {count} requests in one record")
        if len({request_id for request_id, _ in answered}) != count:
            raise Corrupt("answers to one request twice in a record")
        for request_id, _ in answered[1:]:
            expected = _expected(expected_of, request_id)
            if expected.outputs != first.outputs:
                raise Corrupt("answers to requests of different outputs in one record")
            wanted.append(expected)
    if not 0 < rows <= first.max_batch_rows:
        raise Corrupt(f"a batch of {rows} rows; the model takes {first.max_batch_rows}")
    outputs, end = _tensors(view, at, n_out)
    if end != len(view):
        raise Corrupt("bytes after the reply's last output")
    if sorted(t.position for t in outputs) != sorted(first.outputs):
        sent = [t.position for t in outputs]
        raise Corrupt(f"outputs {sent} for a request of {list(first.outputs)}")
    total = sum(e.rows for e in wanted)
    for tensor in outputs:
        if len(tensor.data) != math.prod(tensor.shape) * first.itemsizes[tensor.position]:
            raise Corrupt(f"an output of shape {list(tensor.shape)} in {len(tensor.data)} bytes")
        if total and (not tensor.shape or tensor.shape[0] != total):
            raise Corrupt(f"an output of shape {list(tensor.shape)} for {total} rows")
    timings = Timings(*(min(t, _MAX_NS) for t in (t_in, t_run, t_out)))
    if count == 1:  # all of each output is the request's (a model that does not batch too)
        ((request_id, queued),) = answered
        return [
            Reply(
                request_id,
                batch,
                rows,
                timings,
                min(queued, _MAX_NS),
                outputs,
                counts_batch=bool(code),
            )
        ]
    replies: list[Reply] = []
    start = 0
    for (request_id, queued), expected in zip(answered, wanted, strict=True):
        mine = tuple(_rows_of(t, start, expected.rows, total) for t in outputs)
        start += expected.rows
        counts = bool(code) and not replies  # the record's first answer counts the batch
        replies.append(
            Reply(request_id, batch, rows, timings, min(queued, _MAX_NS), mine, counts_batch=counts)
        )
    return replies


def _rows_of(tensor: Tensor, start: int, rows: int, total: int) -> Tensor:
    """One request's rows of an output that holds `total`."""
    row = len(tensor.data) // total
    return Tensor(
        tensor.position, (rows, *tensor.shape[1:]), tensor.data[start * row : (start + rows) * row]
    )


def _expected(expected_of: ExpectedOf, request_id: int) -> Expected:
    expected = expected_of(request_id)
    if expected is None:
        raise Corrupt(f"a reply to request {request_id}, which it was not sent")
    return expected


def _failure(view: memoryview, expected_of: ExpectedOf) -> Reply:
    if len(view) < _FAILURE.size:
        raise Corrupt(f"a failure of {len(view)} bytes")
    _, code, request_id, length = _FAILURE.unpack_from(view)
    if code not in (FAILED, TOO_LARGE, EXPIRED, CANCELLED):
        raise Corrupt(f"a failure of kind {code}")
    if length > MAX_FAILURE_TEXT or _FAILURE.size + length != len(view):
        raise Corrupt(f"a failure text of {length} bytes in a record of {len(view)}")
    _expected(expected_of, request_id)
    text = bytes(view[_FAILURE.size :]).decode(errors="replace")
    return Reply(request_id, 0, 0, Timings(0, 0, 0), 0, failure=code, text=text)


_MAX_NS = 3600 * 10**9  # a worker's timings are its own word: bounded so statistics stay sane
