"""A numpy-level client for the Open Inference Protocol: arrays in, arrays out.

`grpc://host:port` speaks gRPC over HTTP/2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc

DEFAULT_PORT = 8001
MAX_MESSAGE_BYTES = 64 << 20

# The protocol's datatype names for numpy dtypes (BF16 has no numpy dtype).
_DATATYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
}
_NUMPY = {v: np.dtype(k) for k, v in _DATATYPES.items()}


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str
    port: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_url(url: str) -> Target:
    """`grpc://host:port`; a bare `host:port` means grpc."""
    parts = urlsplit(url if "://" in url else f"grpc://{url}")
    if parts.scheme != "grpc":
        raise ValueError(
            f"unsupported URL scheme {parts.scheme!r} in {url!r}; use grpc://HOST:PORT"
        )
    if not parts.hostname:
        raise ValueError(f"URL {url!r} names no host; use grpc://HOST:PORT")
    return Target(parts.scheme, parts.hostname, parts.port or DEFAULT_PORT)


def datatype_of(array: np.ndarray[Any, Any]) -> str:
    try:
        return _DATATYPES[array.dtype.name]
    except KeyError:
        raise ValueError(f"numpy dtype {array.dtype} has no protocol datatype") from None


def build_request(
    model: str,
    inputs: Mapping[str, np.ndarray[Any, Any]],
    outputs: Sequence[str] = (),
    version: str = "",
    request_id: str = "",
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, array in inputs.items():
        request.inputs.add(name=name, datatype=datatype_of(array), shape=array.shape)
        request.raw_input_contents.append(
            np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        )
    for name in outputs:
        request.outputs.add(name=name)
    return request


def parse_response(response: pb.ModelInferResponse) -> dict[str, np.ndarray[Any, Any]]:
    arrays = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        dtype = _NUMPY[tensor.datatype].newbyteorder("<")
        arrays[tensor.name] = np.frombuffer(raw, dtype=dtype).reshape(tuple(tensor.shape))
    return arrays


class InferenceClient:
    """Synchronous client; one channel, reused for every call."""

    def __init__(self, url: str = f"grpc://localhost:{DEFAULT_PORT}") -> None:
        self.target = parse_url(url)
        self._channel = grpc.insecure_channel(
            self.target.address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self.stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray[Any, Any]],
        outputs: Sequence[str] = (),
        version: str = "",
        timeout: float | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        request = build_request(model, inputs, outputs, version)
        return parse_response(self.stub.ModelInfer(request, timeout=timeout))

    def metadata(self, model: str, version: str = "") -> pb.ModelMetadataResponse:
        response: pb.ModelMetadataResponse = self.stub.ModelMetadata(
            pb.ModelMetadataRequest(name=model, version=version)
        )
        return response

    def index(self) -> list[pb.RepositoryIndexResponse.ModelIndex]:
        return list(self.stub.RepositoryIndex(pb.RepositoryIndexRequest()).models)

    def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        response = self._health.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
