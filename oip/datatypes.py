"""Datatypes as the protocol, the model configuration, numpy and Paddle name them.

One table, so a datatype added here is known everywhere at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from protos.inference import model_config_pb2 as mc


@dataclass(frozen=True)
class Datatype:
    name: str  # Open Inference Protocol spelling: "FP32"
    config_type: mc.DataType  # ModelConfig DataType enum value: TYPE_FP32
    numpy: np.dtype[Any]
    contents_field: str | None  # InferTensorContents field for typed contents, if any


def _dt(name: str, config_type: mc.DataType, dtype: str, field: str | None) -> Datatype:
    return Datatype(name, config_type, np.dtype(dtype), field)


# BF16 has no numpy dtype; its raw bytes travel as uint16 and are never reinterpreted here.
DATATYPES: tuple[Datatype, ...] = (
    _dt("BOOL", mc.TYPE_BOOL, "bool", "bool_contents"),
    _dt("UINT8", mc.TYPE_UINT8, "<u1", "uint_contents"),
    _dt("UINT16", mc.TYPE_UINT16, "<u2", "uint_contents"),
    _dt("UINT32", mc.TYPE_UINT32, "<u4", "uint_contents"),
    _dt("UINT64", mc.TYPE_UINT64, "<u8", "uint64_contents"),
    _dt("INT8", mc.TYPE_INT8, "<i1", "int_contents"),
    _dt("INT16", mc.TYPE_INT16, "<i2", "int_contents"),
    _dt("INT32", mc.TYPE_INT32, "<i4", "int_contents"),
    _dt("INT64", mc.TYPE_INT64, "<i8", "int64_contents"),
    _dt("FP16", mc.TYPE_FP16, "<f2", None),
    _dt("BF16", mc.TYPE_BF16, "<u2", None),
    _dt("FP32", mc.TYPE_FP32, "<f4", "fp32_contents"),
    _dt("FP64", mc.TYPE_FP64, "<f8", "fp64_contents"),
    # Variable-length elements: numpy holds them as objects (bytes), and on the wire and in
    # shared memory each is a 4-byte little-endian length followed by its contents.
    _dt("BYTES", mc.TYPE_STRING, "O", "bytes_contents"),
)

BY_NAME = {d.name: d for d in DATATYPES}
BY_CONFIG_TYPE = {d.config_type: d for d in DATATYPES}
# Paddle's dtype names (str(paddle.float32) == "paddle.float32") for the types Paddle has.
PADDLE_NAMES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "bfloat16": "BF16",
    "float32": "FP32",
    "float64": "FP64",
}


def from_numpy(dtype: np.dtype[Any]) -> Datatype:
    """The protocol datatype of a numpy array, in either byte order (senders write it
    little-endian); object arrays (of bytes or str) and numpy bytes arrays are BYTES. BF16
    never comes back from here."""
    if dtype.kind in "OS":
        return BY_NAME["BYTES"]
    little_endian = dtype.newbyteorder("<")
    for d in DATATYPES:
        if d.numpy == little_endian and d.name != "BF16":
            return d
    raise ValueError(f"numpy dtype {dtype} has no protocol datatype")


def is_bytes(dtype: np.dtype[Any] | str) -> bool:
    return np.dtype(dtype).kind == "O"


def config_type_name(config_type: mc.DataType) -> str:
    return str(mc.DataType.Name(config_type))
