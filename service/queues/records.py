"""What travels in an instance's request ring: requests (and cancellations) from the process
holding the calls to the worker, and the tensor encoding the replies (replies.py) share.

Names are indexes into the lists the worker was given with its queues (QueueSetup), so a
record holds shapes, bytes and a few numbers.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from service.queues.ring import Corrupt, RingWriter, aligned8

REQUEST, CANCEL = 1, 2
ALONE = 1  # flags: runs in a batch of its own (after its worker died running it)
MAX_RANK = 16
MAX_DIM = 1 << 40
NO_TIME = math.nan

_REQUEST = struct.Struct("<BBHHHIQdd")  # kind, flags, inputs, outputs, priority, rows, id, ...
_CANCEL = struct.Struct("<BxxxxxxxQ")
_TENSOR = struct.Struct("<HHIQ")  # index, rank, 0, nbytes; then rank dims, then the data


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


_HEADS = [struct.Struct(f"<HHIQ{rank}Q") for rank in range(MAX_RANK + 1)]  # _TENSOR + dims
_DIMS = [struct.Struct(f"<{rank}Q") for rank in range(MAX_RANK + 1)]
_INDEXES = [struct.Struct(f"<{count}H") for count in range(64)]
_REQUEST_AT = aligned8(_REQUEST.size)


def _indexes(count: int) -> struct.Struct:
    return _INDEXES[count] if count < len(_INDEXES) else struct.Struct(f"<{count}H")


def tensor_size(shape: Sequence[int], nbytes: int) -> int:
    return _TENSOR.size + 8 * len(shape) + ((nbytes + 7) & ~7)


def pack_tensor(buf: memoryview, at: int, index: int, shape: Sequence[int], data: bytes) -> int:
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
        at = pack_tensor(buf, at, index, shape, data)
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


def read_tensors(payload: memoryview, at: int, count: int) -> tuple[tuple[Tensor, ...], int]:
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
    inputs, _ = read_tensors(view, at, n_in)
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
        spans: list[tuple[int, int]] = []  # each input's data, where a second request joins
        # The next one's length and first fields before the whole form is built: requests of
        # forms taking turns (another priority, other outputs) are each a run of one.
        if end < count and len(payloads[end]) == size and payloads[end][:_VARYING_AT] == head:
            fixed, spans = _layout(record)
            form = fixed.unpack_from(payload)  # what the others must hold
            while end < count and len(after := payloads[end]) == size:
                if fixed.unpack_from(after) != form:
                    break
                end += 1
        taken.append(_run(record, payloads[index:end], spans))
        index = end
    return taken


def _layout(record: Request) -> tuple[struct.Struct, list[tuple[int, int]]]:
    """A request's fixed fields as one struct, which skips its id and times, the padding
    (a writer leaves it as it was) and its tensors' data: one call reads all that another
    request of the same form must hold. And where each tensor's data is."""
    outputs = len(record.outputs)
    skipped = _VARYING.size + _REQUEST_AT - _REQUEST.size  # id, times, padding
    layout = [f"<{_VARYING_AT}s{skipped}x{outputs}H"]
    at = _REQUEST_AT + 2 * outputs
    layout.append(f"{aligned8(at) - at}x")
    at = aligned8(at)
    data = []
    for tensor in record.inputs:
        nbytes = len(tensor.data)
        start = at + _TENSOR.size + 8 * len(tensor.shape)
        layout.append(f"{_TENSOR.format[1:]}{len(tensor.shape)}Q{aligned8(nbytes)}x")
        data.append((start, start + nbytes))
        at = start + aligned8(nbytes)
    return _fixed("".join(layout)), data


@functools.lru_cache(maxsize=256)
def _fixed(layout: str) -> struct.Struct:
    return struct.Struct(layout)


def _run(
    first: Request, payloads: Sequence[bytes | memoryview], spans: list[tuple[int, int]]
) -> Run:
    """The run of these requests (`spans`: where each input's data is in each of them)."""
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
        for t, (a, b) in zip(first.inputs, spans, strict=True)
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
