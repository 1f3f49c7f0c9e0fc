"""Descriptors, sans I/O: ModelInfer calls a front-end decoded and validated itself, and their
answers, as flat frames the parent reads without protobuf.

The parent describes the versions it serves (MODELS: each one's config and a token); a
front-end passes a ModelInfer call on such a version as INFER (the call's Open, then the
request's names, shapes and tensor bytes); the parent answers it with one MESSAGE holding a
described answer, or STALE when the front-end's view no longer holds (it then passes the call
on as bytes, as every other call). A call the version's validator refuses, the front-end
answers itself and reports as REFUSED (its status and how long it took), which the parent
records as the refusal it would have made."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from oip.datatypes import BY_NAME
from protos.inference import grpc_service_pb2 as pb
from service.frontends.protocol import (
    MAX_TEXT_BYTES,
    Open,
    ProtocolViolation,
    Reader,
    Status,
    decode_open,
    decode_status,
    encode_open,
    encode_status,
    encode_text,
)
from service.inference.jobs import InferJob, InputTensor, OutputTensor

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"  # the one method described
MAX_RANK = 64  # dimensions of one tensor (the wire limits refuse more before parsing)
MAX_PRIORITY = (1 << 63) - 1  # a priority is 8 bytes, signed (negative: none)
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_DIMENSIONS = tuple(struct.Struct(f">{rank}q") for rank in range(MAX_RANK + 1))
_SCHEDULING = struct.Struct(">qd")  # priority, timeout in seconds (negative: none)
_RANK = struct.Struct(">B")
_FLAG = struct.Struct(">?")


@dataclass(frozen=True)
class ViewEntry:
    """A served version as a request names it, for the front-ends to validate against."""

    model: str
    version: str  # as requests name it: "" (the newest ready one) or its number
    token: int  # the version the parent described; checked again on every call
    config: bytes  # its ModelConfig, serialized
    # Each output's labels (its label_filename's lines), for the classification extension:
    # in the entry that names the version by its number.
    labels: tuple[tuple[str, tuple[bytes, ...]], ...] = ()


@dataclass(frozen=True)
class DescribedRequest:
    """A validated ModelInferRequest (field names as the message's, which observers read)."""

    token: int
    model_name: str
    model_version: str
    id: str
    inputs: tuple[InputTensor, ...]
    outputs: tuple[str, ...]  # as the request named them (none: every output)
    priority: int | None
    timeout_s: float | None
    # The outputs to answer as their top k classes (the classification extension): (name, k).
    classes: tuple[tuple[str, int], ...] = ()
    # The job the validator made of it, where the process that validated it serves it too
    # (a front-end writing into the queues itself): not checked again. Never sent.
    job: InferJob | None = field(default=None, compare=False, repr=False)
    # The message itself, for what a decoupled model's request carries beyond the job (its
    # parameters, its id in each response). Never sent.
    message: pb.ModelInferRequest | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class DescribedAnswer:
    """A ModelInferResponse's contents; `fallback`: a fallback model answered."""

    model_name: str
    model_version: str
    id: str
    outputs: tuple[OutputTensor, ...]
    fallback: bool


@dataclass(frozen=True)
class Refusal:
    """A ModelInferRequest the front-end refused with the version's own validator and answered
    itself: the parent records it as the call it would have refused (field names as the
    message's, which observers read)."""

    token: int
    model_name: str
    model_version: str
    id: str
    status: Status


def fits(request_id: str, priority: int | None) -> bool:
    """Whether a request's id and priority fit a descriptor (a request whose do not goes on
    as bytes: the rest of it is bounded by the model it names)."""
    return len(request_id.encode()) <= MAX_TEXT_BYTES and (priority or 0) <= MAX_PRIORITY


@dataclass(frozen=True)
class View:
    """The parent's view: the versions front-ends may describe calls for, and the names of
    every generation model it serves (described or not: a batchstream names any of them)."""

    entries: tuple[ViewEntry, ...]
    generation: tuple[str, ...] = ()


def encode_view(view: View) -> bytes:
    entries = view.entries
    parts = [_U32.pack(len(entries))]
    for entry in entries:
        parts += (
            encode_text(entry.model),
            encode_text(entry.version),
            _U64.pack(entry.token),
            _U32.pack(len(entry.config)),
            entry.config,
            _U16.pack(len(entry.labels)),
        )
        for output, lines in entry.labels:
            parts += (encode_text(output), _U32.pack(len(lines)))
            parts += (piece for line in lines for piece in (_U32.pack(len(line)), line))
    parts.append(_U32.pack(len(view.generation)))
    parts += (encode_text(name) for name in view.generation)
    return b"".join(parts)


def decode_view(payload: bytes) -> View:
    reader = Reader(payload)
    (count,) = reader.unpack(_U32)
    entries = []
    for _ in range(count):
        model, version = reader.text(), reader.text()
        (token,) = reader.unpack(_U64)
        (size,) = reader.unpack(_U32)
        config = reader.take(size)
        (outputs,) = reader.unpack(_U16)
        labels = []
        for _ in range(outputs):
            output = reader.text()
            (count,) = reader.unpack(_U32)
            labels.append(
                (output, tuple(reader.take(reader.unpack(_U32)[0]) for _ in range(count)))
            )
        entries.append(ViewEntry(model, version, token, config, tuple(labels)))
    (count,) = reader.unpack(_U32)
    generation = tuple(reader.text() for _ in range(count))
    reader.end()
    return View(tuple(entries), generation)


def encode_infer(opened: Open, request: DescribedRequest) -> bytes:
    priority = -1 if request.priority is None else request.priority
    timeout = -1.0 if request.timeout_s is None else request.timeout_s
    parts = [
        _named_call(opened, request.token, request.model_name, request.model_version, request.id),
        _SCHEDULING.pack(priority, timeout),
        _U16.pack(len(request.outputs)),
        *(encode_text(name) for name in request.outputs),
        _U16.pack(len(request.classes)),
        *(encode_text(name) + _U64.pack(k) for name, k in request.classes),
        _tensors(request.inputs),
    ]
    return b"".join(parts)


def decode_infer(payload: bytes) -> tuple[Open, DescribedRequest]:
    reader = Reader(payload)
    opened, token, model, version, request_id = _read_named_call(reader)
    priority, timeout = reader.unpack(_SCHEDULING)
    (count,) = reader.unpack(_U16)
    outputs = tuple(reader.text() for _ in range(count))
    (count,) = reader.unpack(_U16)
    classes = tuple((reader.text(), reader.unpack(_U64)[0]) for _ in range(count))
    if any(k == 0 for _, k in classes):
        raise ProtocolViolation("a classification of 0 classes")
    inputs = _read_tensors(reader, InputTensor)
    reader.end()
    request = DescribedRequest(
        token,
        model,
        version,
        request_id,
        inputs,
        outputs,
        None if priority < 0 else priority,
        None if timeout < 0 else timeout,
        classes,
    )
    return opened, request


def encode_refusal(opened: Open, refusal: Refusal, elapsed_ns: int) -> bytes:
    """`elapsed_ns`: from the call's start to its answer, in the front-end."""
    return b"".join(
        (
            _named_call(
                opened, refusal.token, refusal.model_name, refusal.model_version, refusal.id
            ),
            _U64.pack(max(elapsed_ns, 0)),
            encode_status(refusal.status),
        )
    )


def decode_refusal(payload: bytes) -> tuple[Open, Refusal, int]:
    reader = Reader(payload)
    opened, token, model, version, request_id = _read_named_call(reader)
    (elapsed_ns,) = reader.unpack(_U64)
    status = decode_status(reader.rest())
    return opened, Refusal(token, model, version, request_id, status), elapsed_ns


def encode_answer(answer: DescribedAnswer) -> bytes:
    return b"".join(
        (
            encode_text(answer.model_name),
            encode_text(answer.model_version),
            encode_text(answer.id),
            _FLAG.pack(answer.fallback),
            _tensors(answer.outputs),
        )
    )


def decode_answer(payload: bytes) -> DescribedAnswer:
    reader = Reader(payload)
    model, version, request_id = reader.text(), reader.text(), reader.text()
    (fallback,) = reader.unpack(_FLAG)
    outputs = _read_tensors(reader, OutputTensor)
    reader.end()
    return DescribedAnswer(model, version, request_id, outputs, fallback)


def _named_call(opened: Open, token: int, model: str, version: str, request_id: str) -> bytes:
    """What INFER and REFUSED start with: the call's opening, the version's token, and the
    model, version and id as the request named them."""
    call = encode_open(opened)
    return b"".join(
        (
            _U32.pack(len(call)),
            call,
            _U64.pack(token),
            encode_text(model),
            encode_text(version),
            encode_text(request_id),
        )
    )


def _read_named_call(reader: Reader) -> tuple[Open, int, str, str, str]:
    (size,) = reader.unpack(_U32)
    opened = decode_open(reader.take(size))
    (token,) = reader.unpack(_U64)
    return opened, token, reader.text(), reader.text(), reader.text()


def _tensors(tensors: Sequence[InputTensor | OutputTensor]) -> bytes:
    """Each: name, datatype, rank, dimensions, byte count, bytes."""
    parts = [_U16.pack(len(tensors))]
    for tensor in tensors:
        if len(tensor.shape) > MAX_RANK:
            raise ValueError(f"tensor '{tensor.name}' has rank {len(tensor.shape)}")
        parts += (
            encode_text(tensor.name),
            encode_text(tensor.datatype.name),
            _RANK.pack(len(tensor.shape)),
            _DIMENSIONS[len(tensor.shape)].pack(*tensor.shape),
            _U64.pack(len(tensor.data)),
            tensor.data,
        )
    return b"".join(parts)


_Tensor = TypeVar("_Tensor", InputTensor, OutputTensor)


def _read_tensors(reader: Reader, kind: type[_Tensor]) -> tuple[_Tensor, ...]:
    """Read straight into the tensors the job or the answer holds."""
    (count,) = reader.unpack(_U16)
    tensors: list[_Tensor] = []
    for _ in range(count):
        name, type_name = reader.text(), reader.text()
        datatype = BY_NAME.get(type_name)
        if datatype is None:
            raise ProtocolViolation(f"unknown datatype {type_name!r}")
        (rank,) = reader.unpack(_RANK)
        if rank > MAX_RANK:
            raise ProtocolViolation(f"a tensor of rank {rank}")
        shape = reader.unpack(_DIMENSIONS[rank])
        (size,) = reader.unpack(_U64)
        tensors.append(kind(name, datatype, shape, reader.take(size)))
    return tuple(tensors)
