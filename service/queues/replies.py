"""What comes back in an instance's reply ring: each request's answer or failure, written by
the worker, read by the process holding the calls.

A reply is read as hostile input (the worker runs model code): `read_reply` checks every
count, index, shape and length against what the request asked for and raises Corrupt on the
first that does not hold.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from oip.bytes_tensor import scan_bytes, split_bytes
from service.inference.jobs import Timings
from service.queues.records import Tensor, pack_tensor, read_tensors, tensor_size
from service.queues.ring import Corrupt

ANSWER, FAILURE = 1, 2
COUNTS_BATCH = 1  # an answer's code: see Reply.counts_batch
# A failure's kind, which the reader turns into a status.
FAILED, TOO_LARGE, EXPIRED, CANCELLED = 0, 1, 2, 3
# A failure's text, in bytes: a Python model's is cut first, saying how much (at 4096,
# python_model.MAX_FAILURE_BYTES), and must reach its caller so, as on the socket.
MAX_FAILURE_TEXT = 4096

# kind, code, outputs, batch rows, requests answered, batch, timings; then each request's
# (id, queue ns), then the outputs
_ANSWERS = struct.Struct("<BBHIQQQQQ")
_ANSWERED = struct.Struct("<QQ")
_FAILURE = struct.Struct("<BBxxxxxxQI4x")  # kind, failure kind, id, text bytes; then the text


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


def answers_size(count: int, outputs: Sequence[tuple[tuple[int, ...], int]]) -> int:
    """The payload bytes of the answers to `count` requests with outputs of these (shape,
    nbytes): every request's rows of an output together."""
    return (
        _ANSWERS.size
        + _ANSWERED.size * count
        + sum(tensor_size(shape, nbytes) for shape, nbytes in outputs)
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
        at = pack_tensor(buf, at, index, shape, data)


def failure_bytes(request_id: int, kind: int, text: str) -> bytes:
    data = text.encode()[:MAX_FAILURE_TEXT]
    return _FAILURE.pack(FAILURE, kind, request_id, len(data)) + data


@dataclass(frozen=True)
class Expected:
    """What the reply to one request may hold: the outputs it asked for, each with its
    element size, and the rows each must start with (0: the model does not batch)."""

    outputs: tuple[int, ...]
    itemsizes: tuple[int, ...]  # by output index (the setup's outputs); 0: BYTES
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
    outputs, end = read_tensors(view, at, n_out)
    if end != len(view):
        raise Corrupt("bytes after the reply's last output")
    if sorted(t.position for t in outputs) != sorted(first.outputs):
        sent = [t.position for t in outputs]
        raise Corrupt(f"outputs {sent} for a request of {list(first.outputs)}")
    total = sum(e.rows for e in wanted)
    for tensor in outputs:
        elements = math.prod(tensor.shape)
        itemsize = first.itemsizes[tensor.position]
        if not (
            len(tensor.data) == elements * itemsize
            if itemsize
            else scan_bytes(tensor.data, elements).matches(elements)
        ):
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
    counts_of = [e.rows for e in wanted]
    split = [_split(t, counts_of, total, first.itemsizes[t.position]) for t in outputs]
    replies: list[Reply] = []
    for index, ((request_id, queued), expected) in enumerate(zip(answered, wanted, strict=True)):
        mine = tuple(
            Tensor(t.position, (expected.rows, *t.shape[1:]), parts[index])
            for t, parts in zip(outputs, split, strict=True)
        )
        counts = bool(code) and not replies  # the record's first answer counts the batch
        replies.append(
            Reply(request_id, batch, rows, timings, min(queued, _MAX_NS), mine, counts_batch=counts)
        )
    return replies


def _split(tensor: Tensor, rows: list[int], total: int, itemsize: int) -> list[memoryview]:
    """Each request's rows of an output that holds `total` (checked whole already): slices
    of the bytes, or of a BYTES output's elements, row by row."""
    per_row = math.prod(tensor.shape[1:])
    if not itemsize:
        return [memoryview(p) for p in split_bytes(tensor.data, [n * per_row for n in rows])]
    row = len(tensor.data) // total
    parts: list[memoryview] = []
    start = 0
    for count in rows:
        parts.append(tensor.data[start * row : (start + count) * row])
        start += count
    return parts


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
