"""The KServe v2 REST request bodies (JSON tensors) as the data plane's types (answers:
json_outputs.py).

Every check costs what the request declares, not what it sent, as on gRPC: an input's shape is
checked against the model before its `data` is looked at, `data` is then walked no further than
the shape allows (a `[1, 1]` tensor sent with a million values is refused after one length
comparison), and only then are its values converted, a chunk at a time."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from oip.bytes_tensor import serialize_bytes
from oip.datatypes import BY_NAME, Datatype
from service.dataplane.shared_memory import BYTE_SIZE, OFFSET, REGION, Placement
from service.http.json_depth import nesting_depth
from service.inference.classification import CLASSIFICATION
from service.inference.errors import echoed, invalid
from service.inference.jobs import InputTensor, SequenceFlags
from service.inference.validation import (
    CONVERT_CHUNK,
    SEQUENCE_PARAMETERS,
    RequestValidator,
    sequence_flags,
)

MAX_DEPTH = 100  # JSON nesting, as Triton bounds it
# As gRPC's wire limits bound the same fields (service/api/wire_limits.py).
MAX_TENSORS = 1024  # inputs and requested outputs, each, per request
MAX_RANK = 64  # dimensions of one input's shape
MAX_ID_CHARS = 256
# Reads an input from the caller's shared-memory region: (where, name, datatype, shape).
RegionReader = Callable[[Placement, str, str, tuple[int, ...]], bytes]


@dataclass(frozen=True)
class InferRequest:
    """A REST infer request's body, its structure checked, its tensors not yet converted."""

    id: str
    inputs: tuple[Mapping[str, Any], ...]
    outputs: tuple[str, ...]
    class_counts: Mapping[str, int]
    priority: int | None
    timeout_s: float | None
    binary_outputs: bool  # Triton's `binary_data_output`: outputs as binary data by default
    binary: Mapping[str, bool]  # an output's own `binary_data`, where it says
    sequence: SequenceFlags | None  # Triton's sequence_id, sequence_start, sequence_end
    output_regions: Mapping[str, Placement]  # outputs to write into shared-memory regions

    @property
    def regions(self) -> frozenset[str]:
        """The regions the request's tensors name (a name that is not text is refused where
        its tensor is read)."""
        named = {where.region for where in self.output_regions.values()}
        for entry in self.inputs:
            parameters = entry.get("parameters")
            if isinstance(parameters, dict) and isinstance(parameters.get(REGION), str):
                named.add(parameters[REGION])
        return frozenset(named)

    @property
    def names_regions(self) -> bool:
        """Whether a tensor of the request lies in shared memory."""
        return bool(self.output_regions) or any(
            isinstance(i.get("parameters"), dict) and REGION in i["parameters"] for i in self.inputs
        )

    def answers_binary(self, output: str) -> bool:
        return self.binary.get(output, self.binary_outputs)


class BinaryData:
    """The binary section of a body (Triton's binary tensor data extension), taken by the
    inputs that name a `binary_data_size`, in the order the JSON lists them."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.taken = 0

    def take(self, name: str, size: Any) -> bytes:
        if not _is_int(size) or size < 0:
            raise invalid(f"input '{name}': 'binary_data_size' must be an integer >= 0")
        if self.taken + size > len(self.data):
            raise invalid(
                f"input '{name}': 'binary_data_size' {size} runs past the binary data "
                f"({len(self.data) - self.taken} bytes left)"
            )
        self.taken += size
        return bytes(self.data[self.taken - size : self.taken])

    def check_used(self) -> None:
        if self.taken != len(self.data):
            raise invalid(
                f"{len(self.data) - self.taken} bytes of binary data follow the inputs that "
                "name a 'binary_data_size'"
            )


def split(body: bytes, header_length: str | None) -> tuple[bytes | None, BinaryData]:
    """The JSON part of a body and its binary section: `Inference-Header-Content-Length` says
    where the JSON ends (absent: the whole body is JSON; 0: there is no JSON, None, the body
    is one input's bytes: a raw binary request)."""
    if header_length is None:
        return body, BinaryData(memoryview(b""))
    try:
        length = int(header_length)
    except ValueError:
        raise invalid("Inference-Header-Content-Length is not a number") from None
    if length == 0:
        return None, BinaryData(memoryview(body))
    if not 0 < length <= len(body):
        raise invalid(
            f"Inference-Header-Content-Length {length} is not within the body ({len(body)} bytes)"
        )
    view = memoryview(body)
    return body[:length], BinaryData(view[length:])


def parsed(body: bytes) -> Any:
    """The body as JSON, its nesting bounded before it is parsed. A body that opens no more
    arrays and objects than the bound cannot nest deeper: the scan (12% of a small /infer's
    server CPU, measured with py-spy) is skipped for it."""
    opened = body.count(b"[") + body.count(b"{")
    depth = nesting_depth(body) if opened > MAX_DEPTH else 0
    if depth > MAX_DEPTH:
        raise invalid(f"the JSON body nests {depth} deep; at most {MAX_DEPTH}")
    try:
        # orjson: 7 us where json takes 78 for a 256-value row (8% of a small /infer's server
        # CPU). It refuses NaN and Infinity, as Triton's parser does, and reads integers past
        # 64 bits as floats, which no integer tensor takes.
        return orjson.loads(body)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from None


def infer_request(document: Any) -> InferRequest:
    """A document's infer request: `{"id"?, "parameters"?, "inputs": [...], "outputs"?: [...]}`."""
    body = _object(document, "the request body")
    request_id = body.get("id", "")
    if not isinstance(request_id, str):
        raise invalid("'id' must be a string")
    if len(request_id) > MAX_ID_CHARS:
        raise invalid(f"'id' has {len(request_id)} characters; at most {MAX_ID_CHARS}")
    parameters = _object(body.get("parameters", {}), "'parameters'")
    inputs = _array(body.get("inputs"), "'inputs'")
    outputs = _array(body.get("outputs", []), "'outputs'")
    chosen: list[str] = []
    counts: dict[str, int] = {}
    binary: dict[str, bool] = {}
    regions: dict[str, Placement] = {}
    for entry in outputs:
        output = _object(entry, "an entry of 'outputs'")
        name = _string(output.get("name"), "an output's 'name'")
        chosen.append(name)
        options = _object(output.get("parameters", {}), f"output '{echoed(name)}' 'parameters'")
        if (where := placement(options, "output")) is not None:
            regions[name] = where
        if "binary_data" in options:
            binary[name] = _bool(options["binary_data"], "output parameter 'binary_data'")
        if CLASSIFICATION in options:
            k = options[CLASSIFICATION]
            if not _is_int(k) or k <= 0:
                raise invalid("invalid value for 'classification' parameter, expected >= 0")
            counts[name] = k
    return InferRequest(
        request_id,
        tuple(_object(i, "an entry of 'inputs'") for i in inputs),
        tuple(chosen),
        counts,
        _non_negative(parameters, "priority"),
        None if (us := _non_negative(parameters, "timeout")) is None else us / 1e6,
        _bool(parameters.get("binary_data_output", False), "'binary_data_output'"),
        binary,
        sequence_flags({k: parameters[k] for k in SEQUENCE_PARAMETERS if k in parameters}),
        regions,
    )


def input_tensor(
    entry: Mapping[str, Any],
    validator: RequestValidator,
    binary: BinaryData,
    seen: Collection[str] = (),
    region: RegionReader | None = None,
) -> InputTensor:
    """One entry of 'inputs' as a tensor, its shape checked against the model before its data
    is walked, its data walked no further than the shape before its values are converted; with
    `binary_data_size`, its bytes taken from the binary section as they came, with
    `shared_memory_region`, read from the region by `region` (the validator compares their
    length with the shape, as raw contents on gRPC). `seen`: the names of the request's inputs
    before it."""
    name = _string(entry.get("name"), "an input's 'name'")
    if name in seen:  # refused before its data is converted a second time
        raise invalid(f"input '{echoed(name)}' appears more than once")
    datatype = _string(entry.get("datatype"), f"input '{echoed(name)}' 'datatype'")
    sent = _array(entry.get("shape"), f"input '{echoed(name)}' 'shape'", MAX_RANK)
    if not all(_is_int(d) for d in sent):
        raise invalid(f"input '{echoed(name)}': 'shape' must be a list of integers")
    options = _object(entry.get("parameters", {}), f"input '{echoed(name)}' 'parameters'")
    where = placement(options, "input")
    shape = validator.declared_shape(name, datatype, sent)
    if where is not None:
        if "data" in entry or "binary_data_size" in options:
            raise invalid(f"input '{name}': its data lies in shared memory; 'data' is given too")
        if region is None:
            raise invalid(f"input '{name}': no shared-memory region can be read for this request")
        return InputTensor(name, BY_NAME[datatype], shape, region(where, name, datatype, shape))
    if "binary_data_size" in options:
        if "data" in entry:
            raise invalid(f"input '{name}': 'data' and 'binary_data_size' are both given")
        return InputTensor(
            name, BY_NAME[datatype], shape, binary.take(name, options["binary_data_size"])
        )
    data = entry.get("data")
    if not isinstance(data, list):
        raise invalid(f"input '{name}': 'data' must be an array")
    values = flattened(name, data, shape)
    return InputTensor(name, BY_NAME[datatype], shape, converted(name, values, BY_NAME[datatype]))


def flattened(name: str, data: list[Any], shape: tuple[int, ...]) -> list[Any]:
    """`data`, flat or nested row-major, as its flat list of values: nested, every level must
    hold exactly the shape's count (checked a level at a time, so the walk never passes what the
    shape declares); flat, its length must be the shape's element count."""
    count = math.prod(shape)
    if not data or not isinstance(data[0], list):
        if len(data) != count:
            raise invalid(
                f"input '{name}': shape {list(shape)} needs {count} values, 'data' holds "
                f"{len(data)}"
            )
        return data
    level: list[Any] = [data]
    for axis, size in enumerate(shape):
        for item in level:
            if not isinstance(item, list) or len(item) != size:
                raise invalid(
                    f"input '{name}': 'data' does not have shape {list(shape)}: dimension "
                    f"{axis} holds {len(item) if isinstance(item, list) else 'a value'}, "
                    f"not {size}"
                )
        level = list(itertools.chain.from_iterable(level))
    return level


def converted(name: str, values: Sequence[Any], datatype: Datatype) -> bytes:
    """The values as the datatype's little-endian bytes (BYTES: strings as UTF-8, serialized),
    a chunk at a time. Integers must be integral and in range, BOOL true or false, floats
    numbers: JSON cannot say more, so FP16 and BF16 are rounded from the numbers sent."""
    if datatype.name == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise invalid(f"input '{name}': BYTES data must be strings")
        return serialize_bytes(v.encode() for v in values)
    target = np.dtype("<f4") if datatype.name == "BF16" else datatype.numpy
    out = np.empty(len(values), target)
    for start in range(0, len(values), CONVERT_CHUNK):
        piece = values[start : start + CONVERT_CHUNK]
        try:
            chunk = np.array(piece)
        except (ValueError, OverflowError):  # values nested deeper than the shape, unevenly
            chunk = np.array([[]])
        if chunk.dtype.kind == "f" and datatype.numpy.kind in "iu" and _integers(piece):
            # Integers on both sides of 2**63 have no numpy type in common (numpy makes them
            # floats, losing digits): Python's integers compare exactly.
            chunk = np.array(piece, dtype=object)
        if chunk.ndim != 1 or not _fits(chunk, datatype):
            raise invalid(
                f"input '{name}': 'data' must hold {_expected(datatype)} for {datatype.name}"
            )
        out[start : start + CONVERT_CHUNK] = chunk
    if datatype.name == "BF16":
        return _bf16(out).tobytes()
    return out.tobytes()


def _fits(chunk: np.ndarray[Any, Any], datatype: Datatype) -> bool:
    kind: str = chunk.dtype.kind
    if datatype.name == "BOOL":
        return kind == "b"
    if datatype.numpy.kind == "f" or datatype.name == "BF16":
        return kind in "iuf"
    if kind not in "iuO" or (kind == "O" and not _integers(chunk.tolist())):
        return False  # O: Python's integers, beyond what one numpy type holds
    limits = np.iinfo(datatype.numpy)
    return not chunk.size or (int(chunk.min()) >= limits.min and int(chunk.max()) <= limits.max)


def _expected(datatype: Datatype) -> str:
    if datatype.name == "BOOL":
        return "true or false"
    if datatype.numpy.kind == "f" or datatype.name == "BF16":
        return "numbers"
    limits = np.iinfo(datatype.numpy)
    return f"integers from {limits.min} to {limits.max}"


def _bf16(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """FP32 values rounded to BF16 (to nearest, ties to even), as uint16 bit patterns."""
    bits = values.view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2")


def _integers(values: Sequence[Any]) -> bool:
    return all(_is_int(v) for v in values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _non_negative(parameters: Mapping[str, Any], key: str) -> int | None:
    """Triton's request parameters `priority` (1 = highest) and `timeout` (microseconds)."""
    if key not in parameters:
        return None
    value = parameters[key]
    if not _is_int(value):
        raise invalid(f"request parameter '{key}' must be an integer")
    if value < 0:
        raise invalid(f"request parameter '{key}' must not be negative")
    return int(value)


def placement(options: Mapping[str, Any], what: str) -> Placement | None:
    """A tensor's shared-memory parameters (None: it names no region), as gRPC's are read."""
    if REGION not in options:
        return None
    region = options[REGION]
    if not isinstance(region, str):
        raise invalid(f"{what} parameter {REGION} must be a string")
    if BYTE_SIZE not in options:
        raise invalid(f"{what} parameter {REGION} needs {BYTE_SIZE}")
    numbers = [options[BYTE_SIZE], options.get(OFFSET, 0)]
    for key, value in zip((BYTE_SIZE, OFFSET), numbers, strict=True):
        if not _is_int(value) or value < 0:
            raise invalid(f"{what} parameter {key} must be a non-negative integer")
    return Placement(region, numbers[0], numbers[1])


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(f"{what} must be true or false")
    return value


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"{what} must be a JSON object")
    return value


def _array(value: Any, what: str, most: int = MAX_TENSORS) -> list[Any]:
    if not isinstance(value, list):
        raise invalid(f"{what} must be a JSON array")
    if len(value) > most:
        raise invalid(f"{what} has {len(value)} entries; at most {most}")
    return value


def _string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise invalid(f"{what} must be a string")
    return value
