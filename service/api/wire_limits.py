"""Limits on a ModelInferRequest's wire form, checked before protobuf parses it.

Parsing costs what the message holds, and some entries cost far more parsed than on the wire:
an empty `inputs` entry is 2 bytes and becomes a message object (8 MiB of them took 1.9 s and
350 MB to parse on the event loop; requested outputs and parameter map entries are alike, and
a packed shape of 8M dimensions took 0.5 s). So the entries that parse into objects are counted
first, reading tags and lengths only (never the contents), and a request holding more than any
model takes is refused with INVALID_ARGUMENT before it is parsed; so is an `id` longer than
MAX_ID_BYTES. The scan reads at most
MAX_FIELDS tags, whatever the message's size (8 MiB of empty inputs: 1,025 tags, a few ms).
With `--frontends N` the parent, which parses for every front-end, checks first too."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from protos.inference import grpc_service_pb2 as pb
from transport.grpc.wrapping import HANDLER_BUILDERS, Handler, WrappingServer, behavior_of

MAX_TENSORS = 1024  # inputs, requested outputs, raw_input_contents: each, per request
MAX_PARAMETERS = 1024  # entries of one parameters map
MAX_RANK = 64  # dimensions of one input's shape
MAX_FIELDS = 1 << 13  # tags the scan reads in all: its own work, bounded
# A request's `id` is the caller's text, echoed in every response (each token of a generation)
# and quoted in logs: an id of 16 MiB grew a front-end by 1.2 GB. Triton's ids are short.
MAX_ID_BYTES = 256
_VARINT_BYTES = 10  # the longest varint

_REQUEST = pb.ModelInferRequest.DESCRIPTOR.fields_by_name
_INPUT = pb.ModelInferRequest.InferInputTensor.DESCRIPTOR.fields_by_name
_OUTPUT = pb.ModelInferRequest.InferRequestedOutputTensor.DESCRIPTOR.fields_by_name
_ID = _REQUEST["id"].number
_LENGTH_DELIMITED, _VARINT, _FIXED64, _FIXED32 = 2, 0, 1, 5


class _Malformed(Exception):
    """Not valid wire format: the parser will say so."""


Field = tuple[int, int, int, int]  # number, wire type, where its value starts and ends
Limits = Mapping[int, tuple[int, str]]  # field number -> most entries, what they are


@dataclass
class WireScan:
    """A walk over tags and lengths: how many it read, and the first limit found exceeded."""

    data: bytes
    fields_read: int = 0
    problem: str = ""

    def fields(self, start: int, end: int, limits: Limits) -> list[Field]:
        """The fields of data[start:end]; stops at the first field past its limit or past
        MAX_FIELDS in all (`problem` says which)."""
        found: list[Field] = []
        counts: dict[int, int] = {}
        offset = start
        while offset < end and not self.problem:
            if self.fields_read == MAX_FIELDS:
                self.problem = f"the request has more than {MAX_FIELDS} fields"
                break
            self.fields_read += 1
            tag, offset = self._varint(offset, end)
            number, wire_type = tag >> 3, tag & 7
            if wire_type == _VARINT:
                value_start = offset
                _, offset = self._varint(offset, end)
            elif wire_type == _LENGTH_DELIMITED:
                size, value_start = self._varint(offset, end)
                offset = value_start + size
            elif wire_type in (_FIXED64, _FIXED32):
                value_start = offset
                offset += 8 if wire_type == _FIXED64 else 4
            else:
                raise _Malformed
            if offset > end:
                raise _Malformed
            if number in limits:
                most, what = limits[number]
                counts[number] = counts.get(number, 0) + 1
                if counts[number] > most:
                    self.problem = f"the request has more than {most} {what}"
            found.append((number, wire_type, value_start, offset))
        return found

    def _varint(self, offset: int, end: int) -> tuple[int, int]:
        value = 0
        for index in range(_VARINT_BYTES):
            if offset + index >= end:
                raise _Malformed
            byte = self.data[offset + index]
            value |= (byte & 0x7F) << (7 * index)
            if byte < 0x80:
                return value, offset + index + 1
        raise _Malformed


_REQUEST_LIMITS: Limits = {
    _REQUEST["parameters"].number: (MAX_PARAMETERS, "parameters"),
    _REQUEST["inputs"].number: (MAX_TENSORS, "inputs"),
    _REQUEST["outputs"].number: (MAX_TENSORS, "requested outputs"),
    _REQUEST["raw_input_contents"].number: (MAX_TENSORS, "raw_input_contents"),
}
_INPUT_LIMITS: Limits = {
    _INPUT["parameters"].number: (MAX_PARAMETERS, "parameters of an input"),
    _INPUT["shape"].number: (MAX_RANK, "dimensions in an input's shape"),
}
_OUTPUT_LIMITS: Limits = {
    _OUTPUT["parameters"].number: (MAX_PARAMETERS, "parameters of a requested output"),
}


def request_problem(data: bytes) -> tuple[str, int]:
    """Why a serialized ModelInferRequest holds more than any model takes ("" if it does
    not, or if it is not valid wire format: the parser then says why), and the tags read."""
    scan = WireScan(data)
    try:
        _scan_request(scan)
    except _Malformed:
        return "", scan.fields_read
    return scan.problem, scan.fields_read


def _scan_request(scan: WireScan) -> None:
    for number, _, start, end in scan.fields(0, len(scan.data), _REQUEST_LIMITS):
        if scan.problem:
            return
        if number == _ID and end - start > MAX_ID_BYTES:
            scan.problem = f"the request's id has {end - start} bytes, more than {MAX_ID_BYTES}"
        elif number == _REQUEST["inputs"].number:
            _scan_input(scan, scan.fields(start, end, _INPUT_LIMITS))
        elif number == _REQUEST["outputs"].number:
            scan.fields(start, end, _OUTPUT_LIMITS)


def _scan_input(scan: WireScan, fields: list[Field]) -> None:
    """A packed shape is one field: its dimensions are counted from its bytes."""
    rank = 0
    for number, wire_type, start, end in fields:
        if number != _INPUT["shape"].number:
            continue
        if wire_type != _LENGTH_DELIMITED:
            rank += 1
        elif end - start > MAX_RANK * _VARINT_BYTES:
            rank += MAX_RANK + 1  # more varints than MAX_RANK could take, uncounted
        else:  # one varint ends at each byte below 0x80
            rank += sum(1 for byte in scan.data[start:end] if byte < 0x80)
    if rank > MAX_RANK and not scan.problem:
        scan.problem = f"the request has more than {MAX_RANK} dimensions in an input's shape"


class OverLimits(ValueError):
    """A request over the limits, refused unparsed (`ParsingServer` answers it)."""


def bounded(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`deserializer`, raising OverLimits for a request over the limits, unparsed."""

    @functools.wraps(deserializer)
    def parse(data: bytes) -> Any:
        problem, _ = request_problem(data)
        if problem:
            raise OverLimits(f"{problem}; refused before parsing")
        return deserializer(data)

    return parse


class WireLimitsServer(WrappingServer):
    """Registers the handlers whose requests are ModelInferRequests (ModelInfer, one
    message; ModelStreamInfer, a stream of them) with the limits checked before parsing.
    It must sit inside a `ParsingServer`, which turns the refusal into INVALID_ARGUMENT (in a
    stream, the end of the stream: the messages after it cannot be trusted to be what they
    say)."""

    def wrap(self, method_path: str, handler: Handler) -> Handler:
        if handler.request_deserializer != pb.ModelInferRequest.FromString:
            return handler
        return HANDLER_BUILDERS[handler.request_streaming, handler.response_streaming](
            behavior_of(handler),
            request_deserializer=bounded(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
