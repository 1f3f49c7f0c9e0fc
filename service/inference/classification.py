"""Triton's classification extension: an output requested with the parameter
`classification` (k, an int64) answers, in place of the tensor, the top k of each batch entry
as BYTES `"score:index"` or `"score:index:label"` (the label from the output's
`label_filename`), best first, as Triton's servers format them (src/classification.cc: the
score as C's `%f`, ties in index order)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from oip.bytes_tensor import serialize_bytes
from oip.datatypes import BY_NAME
from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.inference import errors
from service.inference.jobs import OutputTensor

CLASSIFICATION = "classification"
# Per batch entry, as Triton bounds it: sorting more is work a caller could ask for cheaply.
MAX_ELEMENTS = 1_000_000
MAX_LABEL_FILE_BYTES = 16 << 20  # per label file, read once at load
_RANKED = frozenset(
    {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"}
)


class LabelFileError(Exception):
    """A label_filename that cannot be read; the message says which and why."""


def class_counts(request: pb.ModelInferRequest) -> dict[str, int]:
    """Output name -> k, for the outputs the request asks to classify (Triton's texts)."""
    counts = {}
    for output in request.outputs:
        if CLASSIFICATION not in output.parameters:
            continue
        parameter = output.parameters[CLASSIFICATION]
        if parameter.WhichOneof("parameter_choice") != "int64_param":
            raise errors.invalid(
                "invalid value type for 'classification' parameter, expected int64_param"
            )
        if parameter.int64_param <= 0:
            raise errors.invalid("invalid value for 'classification' parameter, expected >= 0")
        counts[output.name] = parameter.int64_param
    return counts


def classified(
    outputs: Sequence[OutputTensor],
    counts: Mapping[str, int],
    batched: bool,
    labels: Mapping[str, Sequence[bytes]],
) -> tuple[OutputTensor, ...]:
    """`outputs` with each one named in `counts` replaced by its top k."""
    return tuple(
        top_k(t, counts[t.name], batched, labels.get(t.name, ())) if t.name in counts else t
        for t in outputs
    )


def top_k(tensor: OutputTensor, k: int, batched: bool, labels: Sequence[bytes]) -> OutputTensor:
    datatype = tensor.datatype.name
    if datatype not in _RANKED:
        raise errors.invalid(
            f"class result not available for output due to unsupported type '{datatype}'"
        )
    values = np.frombuffer(tensor.data, dtype=tensor.datatype.numpy)
    rows = tensor.shape[0] if batched and tensor.shape else 0
    per_row = math.prod(tensor.shape[1:] if rows else tensor.shape)
    if per_row > MAX_ELEMENTS:
        raise errors.invalid("classification output tensor too large")
    integral = datatype not in ("FP32", "FP64")
    taken = min(k, per_row)
    texts: list[bytes] = []
    for row in values.reshape(max(rows, 1), per_row):
        # Descending; equal scores keep index order (a stable sort of the reversed row).
        order = per_row - 1 - np.argsort(row[::-1], kind="stable")[::-1][:taken]
        for index in order.tolist():
            score = str(int(row[index])) if integral else f"{float(row[index]):f}"
            text = f"{score}:{index}".encode()
            label = labels[index] if index < len(labels) else b""
            texts.append(text + b":" + label if label else text)
    shape = (rows, taken) if rows else (taken,)
    return OutputTensor(tensor.name, BY_NAME["BYTES"], shape, serialize_bytes(texts))


def read_labels(model_dir: Path, config: mc.ModelConfig) -> dict[str, tuple[bytes, ...]]:
    """Each output's labels, one a line of its label_filename: a file directly in the
    model's directory (as Triton looks for it), at most MAX_LABEL_FILE_BYTES."""
    found = {}
    for output in config.output:
        if not output.label_filename:
            continue
        name = output.label_filename
        path = model_dir / name
        if Path(name).name != name or name in (".", ".."):
            raise LabelFileError(f"label_filename {name!r} must name a file in {model_dir}")
        try:
            with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as file:
                data = file.read(MAX_LABEL_FILE_BYTES + 1)
        except OSError as exc:
            raise LabelFileError(f"label_filename {name!r}: {exc.strerror}") from None
        if len(data) > MAX_LABEL_FILE_BYTES:
            raise LabelFileError(
                f"label_filename {name!r} is over {MAX_LABEL_FILE_BYTES} bytes (per label file)"
            )
        lines = data.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        found[output.name] = tuple(lines)
    return found
